//! The gRPC service `envoy.service.ext_proc.v3.ExternalProcessor`, method `Process`, serving
//! [`super::wire`]'s messages (bodies as `Bytes`) in place of the `envoy-types` server, whose
//! generated code is tied to its `Vec<u8>` bodies.
//!
//! Owns: routing the one method's path to [`ExtProcService::process`], the message size limits,
//! the codec, and the gRPC `UNIMPLEMENTED` answer for any other path (tonic's `Status::into_http`).
//!
//! The codec decodes as tonic-prost does (tonic already sizes its read buffer from each message's
//! length prefix) and encodes a response into room made for its whole encoded length first: an
//! answer that carries a streamed body back (FULL_DUPLEX_STREAMED) is written once into a buffer
//! of its size, where prost alone would grow tonic's 8 KiB buffer by doubling, copying the body
//! again at each step.

use std::convert::Infallible;
use std::sync::Arc;

use prost::Message;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::{NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstDecoder;

use super::wire::{ProcessingRequest, ProcessingResponse};
use super::ExtProcService;

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
    pub fn new(inner: ExtProcService, limit: usize) -> Self {
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

/// One `Process` call.
struct Process(Arc<ExtProcService>);

impl StreamingService<ProcessingRequest> for Process {
    type Response = ProcessingResponse;
    type ResponseStream = super::ProcessStream;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<ProcessingRequest>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { Ok(inner.process(request)) })
    }
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
        let (method, limits) = (
            Process(self.inner.clone()),
            (Some(self.max_decoding), Some(self.max_encoding)),
        );
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ExtProcCodec)
                .apply_max_message_size_config(limits.0, limits.1);
            Ok(grpc.streaming(method, req).await)
        })
    }
}

/// The `Process` method's codec: requests as tonic-prost decodes them, responses through
/// [`SizedEncoder`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ExtProcCodec;

impl Codec for ExtProcCodec {
    type Encode = ProcessingResponse;
    type Decode = ProcessingRequest;
    type Encoder = SizedEncoder;
    type Decoder = ProstDecoder<ProcessingRequest>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

/// Encodes a response into room reserved for its encoded length, so the buffer is allocated
/// once at its size whatever the body it carries.
#[derive(Debug, Clone, Copy, Default)]
pub struct SizedEncoder;

impl Encoder for SizedEncoder {
    type Item = ProcessingResponse;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, buf: &mut EncodeBuf<'_>) -> Result<(), Self::Error> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding the ext_proc response: {e}")))
    }
}
