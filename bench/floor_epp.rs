//! Benchmark helpers, kept out of the product binary:
//! - `floor_epp epp --listen ADDR --endpoint IP:PORT`: the minimal ext_proc server that always
//!   returns one fixed endpoint, speaking the same protocol modes as kvepp (the floor any EPP pays);
//! - `floor_epp backend --listen ADDR`: a model-server stand-in that reads the body and answers a
//!   fixed small JSON (cheap, so the benchmark measures the EPP hop, not the backend).
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request as Req,
    processing_response::Response as Resp, BodyMutation, BodyResponse, CommonResponse,
    HeaderMutation, HeadersResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone)]
struct Floor {
    endpoint: String,
}

fn routing(endpoint: &str) -> (Option<CommonResponse>, Struct) {
    let header = HeaderValueOption {
        header: Some(HeaderValue {
            key: "x-gateway-destination-endpoint".into(),
            raw_value: endpoint.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: 2,
        ..Default::default()
    };
    let mut inner = Struct::default();
    inner.fields.insert(
        "x-gateway-destination-endpoint".into(),
        Value {
            kind: Some(Kind::StringValue(endpoint.into())),
        },
    );
    let mut md = Struct::default();
    md.fields.insert(
        "envoy.lb".into(),
        Value {
            kind: Some(Kind::StructValue(inner)),
        },
    );
    (
        Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: vec![header],
                remove_headers: vec![],
            }),
            ..Default::default()
        }),
        md,
    )
}

fn chunk(body: Vec<u8>, end_of_stream: bool) -> Option<CommonResponse> {
    let m = Mutation::StreamedResponse(StreamedBodyResponse {
        body,
        end_of_stream,
        ..Default::default()
    });
    Some(CommonResponse {
        body_mutation: Some(BodyMutation { mutation: Some(m) }),
        ..Default::default()
    })
}

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let endpoint = self.endpoint.clone();
        tokio::spawn(async move {
            let (mut duplex_req, mut duplex_resp, mut held) = (false, false, Vec::new());
            while let Ok(Some(msg)) = inbound.message().await {
                if let Some(pc) = &msg.protocol_config {
                    duplex_req = pc.request_body_mode == 4;
                    duplex_resp = pc.response_body_mode == 4;
                }
                let mut out = Vec::new();
                match msg.request {
                    Some(Req::RequestHeaders(h)) if h.end_of_stream || !duplex_req => {
                        let (common, md) = routing(&endpoint);
                        // Buffered: route in the headers answer already (the floor skips the body).
                        out.push(ProcessingResponse {
                            response: Some(Resp::RequestHeaders(HeadersResponse {
                                response: common,
                            })),
                            dynamic_metadata: Some(md),
                            ..Default::default()
                        });
                    }
                    Some(Req::RequestHeaders(_)) => {}
                    Some(Req::RequestBody(b)) if duplex_req => {
                        held.push(b.body);
                        if b.end_of_stream {
                            let (common, md) = routing(&endpoint);
                            out.push(ProcessingResponse {
                                response: Some(Resp::RequestHeaders(HeadersResponse {
                                    response: common,
                                })),
                                dynamic_metadata: Some(md),
                                ..Default::default()
                            });
                            let n = held.len();
                            for (i, c) in held.drain(..).enumerate() {
                                out.push(ProcessingResponse {
                                    response: Some(Resp::RequestBody(BodyResponse {
                                        response: chunk(c, i + 1 == n),
                                    })),
                                    ..Default::default()
                                });
                            }
                        }
                    }
                    Some(Req::RequestBody(_)) => out.push(ProcessingResponse {
                        response: Some(Resp::RequestBody(BodyResponse::default())),
                        ..Default::default()
                    }),
                    Some(Req::ResponseHeaders(_)) => out.push(ProcessingResponse {
                        response: Some(Resp::ResponseHeaders(HeadersResponse::default())),
                        ..Default::default()
                    }),
                    Some(Req::ResponseBody(b)) => {
                        let response = if duplex_resp {
                            chunk(b.body, b.end_of_stream)
                        } else {
                            None
                        };
                        out.push(ProcessingResponse {
                            response: Some(Resp::ResponseBody(BodyResponse { response })),
                            ..Default::default()
                        });
                    }
                    Some(Req::RequestTrailers(_)) => out.push(ProcessingResponse {
                        response: Some(Resp::RequestTrailers(TrailersResponse::default())),
                        ..Default::default()
                    }),
                    Some(Req::ResponseTrailers(_)) => out.push(ProcessingResponse {
                        response: Some(Resp::ResponseTrailers(TrailersResponse::default())),
                        ..Default::default()
                    }),
                    None => {}
                }
                for r in out {
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let listen: SocketAddr = arg("--listen").ok_or("--listen ADDR")?.parse()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    match args.get(1).map(String::as_str) {
        Some("epp") => {
            let endpoint = arg("--endpoint").ok_or("--endpoint IP:PORT")?;
            // TCP_NODELAY as kvepp does: without it small messages wait for delayed ACKs.
            let incoming = tokio_stream::StreamExt::map(TcpListenerStream::new(listener), |s| {
                let s = s?;
                s.set_nodelay(true)?;
                Ok::<_, std::io::Error>(s)
            });
            tonic::transport::Server::builder()
                .initial_stream_window_size(8u32 << 20)
                .initial_connection_window_size(32u32 << 20)
                .add_service(
                    ExternalProcessorServer::new(Floor { endpoint })
                        .max_decoding_message_size(16 << 20)
                        .max_encoding_message_size(16 << 20),
                )
                .serve_with_incoming(incoming)
                .await?;
        }
        Some("backend") => {
            let app = axum::Router::new().fallback(|body: axum::body::Bytes| async move {
                (
                    [("content-type", "application/json")],
                    format!("{{\"received\":{}}}", body.len()),
                )
            });
            axum::serve(listener, app).await?;
        }
        _ => {
            return Err(
                "usage: floor_epp (epp --listen ADDR --endpoint IP:PORT | backend --listen ADDR)"
                    .into(),
            )
        }
    }
    Ok(())
}
