//! The gRPC service `envoy.service.ext_proc.v3.ExternalProcessor`, method `Process`, serving
//! [`super::wire`]'s messages (bodies as `Bytes`) in place of the `envoy-types` server, whose
//! generated code is tied to its `Vec<u8>` bodies.
//!
//! Owns: routing the one method's path to [`ExtProcService::process`], the message size limits,
//! the request side of the codec, and the gRPC `UNIMPLEMENTED` answer for any other path or a
//! compressed request (tonic's `Status::into_http`).
//!
//! Requests are decoded as tonic-prost decodes them (tonic sizes its read buffer from each
//! message's length prefix; a body is a slice of that buffer). Responses are framed by
//! [`kvepp_extproc_wire::framing::ResponseBody`], which sends a body chunk going back to Envoy from where it
//! lies instead of copying it into the outgoing buffer.

use std::convert::Infallible;
use std::sync::Arc;

use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::NamedService;
use tonic::{Request, Status, Streaming};
use tonic_prost::ProstDecoder;

use super::wire::ProcessingRequest;
use super::ExtProcService;
use kvepp_extproc_wire::framing::ResponseBody;

/// The service's full name, as Envoy's `grpc_service` calls it.
pub const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// The one method's path.
const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// [`ExtProcService`] as a tower service for tonic's router.
#[derive(Debug, Clone)]
pub struct ExtProcServer {
    inner: Arc<ExtProcService>,
    max_decoding: usize,
    max_encoding: usize,
}

impl ExtProcServer {
    /// Serves `inner`, refusing messages above `limit` bytes either way.
    pub(crate) fn new(inner: ExtProcService, limit: usize) -> Self {
        ExtProcServer {
            inner: Arc::new(inner),
            max_decoding: limit,
            max_encoding: limit,
        }
    }
}

impl NamedService for ExtProcServer {
    const NAME: &'static str = SERVICE;
}

impl<B> Service<http::Request<B>> for ExtProcServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PROCESS {
            let status =
                Status::unimplemented(format!("{SERVICE} has no method {}", req.uri().path()));
            return Box::pin(async move { Ok(status.into_http()) });
        }
        if let Some(status) = unsupported_encoding(req.headers()) {
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let (inner, max_decoding, max_encoding) =
            (self.inner.clone(), self.max_decoding, self.max_encoding);
        Box::pin(async move {
            let request = Request::from_http(req.map(|body| {
                Streaming::new_request(
                    ProstDecoder::<ProcessingRequest>::default(),
                    body,
                    None,
                    Some(max_decoding),
                )
            }));
            let answers = inner.process(request).into_inner();
            let mut response = http::Response::new(tonic::body::Body::new(ResponseBody::new(
                answers,
                max_encoding,
            )));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            Ok(response)
        })
    }
}

/// `UNIMPLEMENTED` for a request compressed other than `identity` (kvepp reads messages as
/// they come; Envoy does not compress ext_proc streams).
fn unsupported_encoding(headers: &http::HeaderMap) -> Option<Status> {
    let value = headers.get("grpc-encoding")?;
    (value.as_bytes() != b"identity").then(|| {
        Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            String::from_utf8_lossy(value.as_bytes())
        ))
    })
}
