//! A wire-level OTLP trace receiver (the OpenTelemetry Collector cannot be installed here): the
//! real gRPC service from the `opentelemetry-proto` definitions on 127.0.0.1, keeping every span
//! it is sent with its resource's `service.name`.
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

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.0.lock().expect("sink");
        for rs in request.into_inner().resource_spans {
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

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.sink.0.lock().expect("sink").clone()
    }
}
