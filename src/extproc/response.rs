//! Builders for the ext_proc messages kvepp sends back to the proxy.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;

use super::wire::{
    body_mutation, processing_response::Response, BodyMutation, BodyResponse, CommonResponse,
    HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

use kvepp_core::Pick;

pub(crate) const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub(crate) const LB_NAMESPACE: &str = "envoy.lb";
pub(crate) const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
pub(crate) const FALLBACK_KEY: &str = "x-gateway-destination-endpoint-fallback";
/// The candidates' scores (header and `envoy.lb` metadata key), with `emit_endpoint_scores`.
pub(crate) const SCORES_KEY: &str = "x-gateway-destination-endpoint-scores";
pub use kvepp_core::disagg::PREFILLER_HEADER;
pub(crate) const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
pub(crate) const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub(crate) const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Chunk size for a rewritten streamed body (Envoy recommends ≤ 64 KiB, or its gRPC message limit).
pub(crate) const MAX_STREAMED_CHUNK: usize = 64 * 1024;

/// The destination value: `primary`, or `primary,fallback` in the ordered-list form.
pub(crate) fn destination_value(pick: &Pick, list_form: bool) -> String {
    match (&pick.fallback, list_form) {
        (Some(fb), true) => format!("{},{}", pick.primary.addr_str, fb.addr_str),
        _ => pick.primary.addr_str.to_string(),
    }
}

pub(super) fn set_header(key: &str, value: Vec<u8>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value,
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// Header mutation that routes the request: the destination header (overwriting anything the
/// client sent), when the body changed length or the proxy strips it `content-length`, and when
/// the pick carries them the candidates' scores.
pub(crate) fn routing_mutation(
    destination: &str,
    content_length: Option<usize>,
    pick: &Pick,
) -> HeaderMutation {
    let mut set_headers = vec![set_header(
        DESTINATION_HEADER,
        destination.as_bytes().to_vec(),
    )];
    if let Some(len) = content_length {
        set_headers.push(set_header("content-length", len.to_string().into_bytes()));
    }
    if let Some(scores) = &pick.scores {
        set_headers.push(set_header(SCORES_KEY, scores_json(scores).into_bytes()));
    }
    // The prefill worker when the pick has one; otherwise whatever the client sent goes (it
    // must not steer a decode worker's sidecar to a prefill worker of its choosing).
    let mut remove_headers = Vec::new();
    match &pick.pairing {
        Some(p) => set_headers.push(set_header(
            PREFILLER_HEADER,
            p.prefill.addr_str.as_bytes().to_vec(),
        )),
        None => remove_headers.push(PREFILLER_HEADER.to_owned()),
    }
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// `{"ip:port": score, ...}`, addresses in order: the header form of the scores.
fn scores_json(scores: &[(std::sync::Arc<kvepp_core::Endpoint>, f64)]) -> String {
    let map: serde_json::Map<String, serde_json::Value> = scores
        .iter()
        .map(|(ep, v)| (ep.addr_str.to_string(), serde_json::json!(v)))
        .collect();
    serde_json::Value::Object(map).to_string()
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// `envoy.lb` dynamic metadata carrying the same destination as the header, plus the fallback.
pub(crate) fn lb_metadata(destination: &str, pick: &Pick) -> Struct {
    let mut inner = Struct::default();
    inner
        .fields
        .insert(DESTINATION_KEY.to_owned(), string_value(destination));
    if let Some(fb) = &pick.fallback {
        inner
            .fields
            .insert(FALLBACK_KEY.to_owned(), string_value(&fb.addr_str));
    }
    if let Some(scores) = &pick.scores {
        let fields = scores
            .iter()
            .map(|(ep, v)| {
                let n = Value {
                    kind: Some(Kind::NumberValue(*v)),
                };
                (ep.addr_str.to_string(), n)
            })
            .collect();
        inner.fields.insert(
            SCORES_KEY.to_owned(),
            Value {
                kind: Some(Kind::StructValue(Struct { fields })),
            },
        );
    }
    let mut outer = Struct::default();
    outer.fields.insert(
        LB_NAMESPACE.to_owned(),
        Value {
            kind: Some(Kind::StructValue(inner)),
        },
    );
    outer
}

fn common(
    header_mutation: Option<HeaderMutation>,
    body_mutation: Option<BodyMutation>,
) -> Option<CommonResponse> {
    Some(CommonResponse {
        header_mutation,
        body_mutation,
        ..Default::default()
    })
}

pub(crate) fn request_headers(
    mutation: Option<HeaderMutation>,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: common(mutation, None),
        })),
        dynamic_metadata: metadata,
    }
}

/// BUFFERED-mode answer to the request body: routing headers, optional replaced body, metadata.
pub(crate) fn request_body_buffered(
    mutation: HeaderMutation,
    body: Option<Vec<u8>>,
    metadata: Struct,
) -> ProcessingResponse {
    let body_mutation = body.map(|b| BodyMutation {
        mutation: Some(body_mutation::Mutation::Body(Bytes::from(b))),
    });
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: common(Some(mutation), body_mutation),
        })),
        dynamic_metadata: Some(metadata),
    }
}

fn streamed(body: Bytes, end_of_stream: bool) -> Option<CommonResponse> {
    let mutation = body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
        body,
        end_of_stream,
    });
    common(
        None,
        Some(BodyMutation {
            mutation: Some(mutation),
        }),
    )
}

/// A body chunk sent back in FULL_DUPLEX_STREAMED mode (the chunk as it came: not copied).
pub(crate) fn request_body_chunk(body: Bytes, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: streamed(body, end_of_stream),
        })),
        ..Default::default()
    }
}

pub(crate) fn response_body_chunk(body: Bytes, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: streamed(body, end_of_stream),
        })),
        ..Default::default()
    }
}

pub(crate) fn response_headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..Default::default()
    }
}

pub(crate) fn response_body_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse::default())),
        ..Default::default()
    }
}

pub(crate) fn request_body_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse::default())),
        ..Default::default()
    }
}

pub(crate) fn trailers_continue(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    let response = if request {
        Response::RequestTrailers(t)
    } else {
        Response::ResponseTrailers(t)
    };
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// OpenAI-style error body.
pub(crate) fn error_body(status: u16, kind: &str, message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "error": {"message": message, "type": kind, "code": status}
    }))
    .unwrap_or_default()
}

/// An answer the proxy sends to the client instead of forwarding the request.
pub(crate) fn immediate(
    status: u16,
    kind: &str,
    message: &str,
    retry_after_s: Option<u64>,
) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", b"application/json".to_vec())];
    if let Some(s) = retry_after_s {
        set_headers.push(set_header("retry-after", s.to_string().into_bytes()));
    }
    let headers = HeaderMutation {
        set_headers,
        remove_headers: Vec::new(),
    };
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(headers),
            body: error_body(status, kind, message),
            details: format!("kvepp_{kind}"),
            ..Default::default()
        })),
        ..Default::default()
    }
}
