//! A wire-level OTLP trace receiver (the OpenTelemetry Collector cannot be installed here): the
//! real gRPC service from the `opentelemetry-proto` definitions on 127.0.0.1, or OTLP/HTTP
//! (`POST /v1/traces`, a protobuf `ExportTraceServiceRequest`), keeping every span it is sent with
//! its resource's `service.name`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;

/// A received span and the `service.name` of its resource.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub span: Span,
}

impl Received {
    /// The span's attribute `key`, as text.
    pub fn attr(&self, key: &str) -> Option<String> {
        attr(&self.span.attributes, key)
    }
}

fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    let v = attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    Some(match v.value.as_ref()? {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

#[derive(Debug, Clone, Default)]
struct Sink(Arc<Mutex<Vec<Received>>>);

impl Sink {
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut out = self.0.lock().expect("sink");
        for rs in request.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    out.push(Received {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
    }
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The receiver, serving until dropped with the test's runtime.
pub struct Collector {
    pub addr: SocketAddr,
    sink: Sink,
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let sink = Sink::default();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(sink.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        tokio::spawn(server);
        Collector { addr, sink }
    }

    /// The OTLP/HTTP receiver: `POST /v1/traces` with a protobuf body.
    pub async fn start_http() -> Collector {
        use prost::Message;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let sink = Sink::default();
        let keep = sink.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let keep = keep.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(r) => {
                            keep.keep(r);
                            (
                                axum::http::StatusCode::OK,
                                ExportTraceServiceResponse::default().encode_to_vec(),
                            )
                        }
                        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
                    }
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        Collector { addr, sink }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.sink.0.lock().expect("sink").clone()
    }
}
