//! kvepp's ext_proc messages against `envoy-types`' (generated from Envoy's protos): what Envoy
//! encodes decodes here to the same values, what kvepp encodes decodes there to the same
//! values, and a decoded body is a slice of the buffer it came in. Its message builders serve
//! the framing tests too.

use std::collections::HashMap;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3 as envoy;
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use prost::Message;

use super::*;

pub(crate) fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

pub(crate) fn a_struct(key: &str, value: &str) -> Struct {
    let mut s = Struct::default();
    s.fields.insert(
        key.to_owned(),
        Value {
            kind: Some(Kind::StringValue(value.to_owned())),
        },
    );
    s
}

pub(crate) fn mutation() -> HeaderMutation {
    HeaderMutation {
        set_headers: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: "x-gateway-destination-endpoint".into(),
                raw_value: b"10.0.0.1:8000".to_vec(),
                ..Default::default()
            }),
            append_action: 2,
            ..Default::default()
        }],
        remove_headers: vec!["x-prefiller-host-port".into()],
    }
}

fn envoy_body(body: &[u8], end_of_stream: bool) -> envoy::HttpBody {
    // The flags kvepp does not read are set too: they must be skipped, not misread.
    envoy::HttpBody {
        body: body.to_vec(),
        end_of_stream,
        end_of_stream_without_message: true,
        grpc_message_compressed: true,
        drain_complete: true,
    }
}

/// One request of each kind Envoy sends, with every envelope field set (those kvepp skips too).
fn envoy_requests() -> Vec<envoy::ProcessingRequest> {
    use envoy::processing_request::{ClientWindowUpdate, FlowControlInit, Request as R};
    let headers = envoy::HttpHeaders {
        headers: Some(header_map(&[(":path", "/v1/completions"), ("x-a", "b")])),
        attributes: HashMap::from([("request".to_owned(), a_struct("path", "/v1"))]),
        end_of_stream: false,
    };
    let trailers = envoy::HttpTrailers {
        trailers: Some(header_map(&[("grpc-status", "0")])),
    };
    let kinds = [
        R::RequestHeaders(headers.clone()),
        R::ResponseHeaders(envoy::HttpHeaders {
            end_of_stream: true,
            ..headers
        }),
        R::RequestBody(envoy_body(br#"{"model":"m","prompt":"hi"}"#, true)),
        R::ResponseBody(envoy_body(b"data: {}\n\n", false)),
        R::RequestTrailers(trailers.clone()),
        R::ResponseTrailers(trailers),
    ];
    let mut out: Vec<_> = kinds
        .into_iter()
        .enumerate()
        .map(|(i, request)| envoy::ProcessingRequest {
            request: Some(request),
            metadata_context: Some(Metadata {
                filter_metadata: HashMap::from([("envoy.lb".to_owned(), a_struct("k", "v"))]),
                ..Default::default()
            }),
            attributes: HashMap::from([("xds".to_owned(), a_struct("cluster", "c"))]),
            observability_mode: i % 2 == 1,
            protocol_config: Some(envoy::ProtocolConfiguration {
                request_body_mode: 4,
                response_body_mode: i as i32 % 5,
                send_body_without_waiting_for_header_response: true,
            }),
            flow_control_init: Some(FlowControlInit {
                initial_window_downstream_to_sidestream: 7,
                ..Default::default()
            }),
            client_window_update: Some(ClientWindowUpdate {
                window_increment_sidestream_to_upstream: 9,
                ..Default::default()
            }),
        })
        .collect();
    out.push(envoy::ProcessingRequest::default());
    out
}

/// What kvepp must read of `e`, written out by hand: the mapping the wire types must agree with.
fn expected(e: &envoy::ProcessingRequest) -> ProcessingRequest {
    use envoy::processing_request::Request as E;
    use processing_request::Request as W;
    let body = |b: &envoy::HttpBody| HttpBody {
        body: Bytes::copy_from_slice(&b.body),
        end_of_stream: b.end_of_stream,
    };
    ProcessingRequest {
        request: e.request.as_ref().map(|r| match r {
            E::RequestHeaders(h) => W::RequestHeaders(h.clone()),
            E::ResponseHeaders(h) => W::ResponseHeaders(h.clone()),
            E::RequestBody(b) => W::RequestBody(body(b)),
            E::ResponseBody(b) => W::ResponseBody(body(b)),
            E::RequestTrailers(t) => W::RequestTrailers(t.clone()),
            E::ResponseTrailers(t) => W::ResponseTrailers(t.clone()),
        }),
        metadata_context: e.metadata_context.clone(),
        observability_mode: e.observability_mode,
        protocol_config: e.protocol_config,
    }
}

#[test]
fn what_envoy_sends_decodes_to_the_same_values() {
    for e in envoy_requests() {
        let decoded = ProcessingRequest::decode(e.encode_to_vec().as_slice());
        assert_eq!(decoded.as_ref().ok(), Some(&expected(&e)), "{e:?}");
    }
}

/// One answer of each kind kvepp sends.
fn our_responses() -> Vec<ProcessingResponse> {
    use body_mutation::Mutation;
    use processing_response::Response as R;
    let common = |body_mutation| {
        Some(CommonResponse {
            status: 0,
            header_mutation: Some(mutation()),
            body_mutation,
            trailers: Some(header_map(&[("x-t", "1")])),
            clear_route_cache: true,
        })
    };
    let streamed = |body: &'static [u8], end_of_stream| {
        Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: Bytes::from_static(body),
                end_of_stream,
            })),
        })
    };
    let whole = Some(BodyMutation {
        mutation: Some(Mutation::Body(Bytes::from_static(br#"{"model":"t"}"#))),
    });
    let cleared = Some(BodyMutation {
        mutation: Some(Mutation::ClearBody(true)),
    });
    let kinds = [
        R::RequestHeaders(HeadersResponse {
            response: common(None),
        }),
        R::ResponseHeaders(HeadersResponse::default()),
        R::RequestBody(BodyResponse {
            response: common(whole),
        }),
        R::RequestBody(BodyResponse {
            response: common(streamed(b"chunk", true)),
        }),
        R::ResponseBody(BodyResponse {
            response: common(streamed(b"", false)),
        }),
        R::ResponseBody(BodyResponse {
            response: common(cleared),
        }),
        R::RequestTrailers(TrailersResponse {
            header_mutation: Some(mutation()),
        }),
        R::ResponseTrailers(TrailersResponse::default()),
        R::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: 429 }),
            headers: Some(mutation()),
            body: b"{}".to_vec(),
            details: "kvepp_queue_full".into(),
            ..Default::default()
        }),
    ];
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, r)| ProcessingResponse {
            response: Some(r),
            dynamic_metadata: (i % 2 == 0).then(|| a_struct("x-gateway-destination-endpoint", "a")),
        })
        .collect()
}

/// `w` in Envoy's types, written out by hand.
fn as_envoys(w: &ProcessingResponse) -> envoy::ProcessingResponse {
    use body_mutation::Mutation as W;
    use envoy::body_mutation::Mutation as E;
    use envoy::processing_response::Response as ER;
    use processing_response::Response as R;
    let common = |c: &Option<CommonResponse>| {
        c.as_ref().map(|c| envoy::CommonResponse {
            status: c.status,
            header_mutation: c.header_mutation.clone(),
            body_mutation: c.body_mutation.as_ref().map(|m| envoy::BodyMutation {
                mutation: m.mutation.as_ref().map(|m| match m {
                    W::Body(b) => E::Body(b.to_vec()),
                    W::ClearBody(c) => E::ClearBody(*c),
                    W::StreamedResponse(s) => E::StreamedResponse(envoy::StreamedBodyResponse {
                        body: s.body.to_vec(),
                        end_of_stream: s.end_of_stream,
                        ..Default::default()
                    }),
                }),
            }),
            trailers: c.trailers.clone(),
            clear_route_cache: c.clear_route_cache,
        })
    };
    envoy::ProcessingResponse {
        response: w.response.as_ref().map(|r| match r {
            R::RequestHeaders(h) => ER::RequestHeaders(envoy::HeadersResponse {
                response: common(&h.response),
            }),
            R::ResponseHeaders(h) => ER::ResponseHeaders(envoy::HeadersResponse {
                response: common(&h.response),
            }),
            R::RequestBody(b) => ER::RequestBody(envoy::BodyResponse {
                response: common(&b.response),
            }),
            R::ResponseBody(b) => ER::ResponseBody(envoy::BodyResponse {
                response: common(&b.response),
            }),
            R::RequestTrailers(t) => ER::RequestTrailers(t.clone()),
            R::ResponseTrailers(t) => ER::ResponseTrailers(t.clone()),
            R::ImmediateResponse(i) => ER::ImmediateResponse(i.clone()),
        }),
        dynamic_metadata: w.dynamic_metadata.clone(),
        ..Default::default()
    }
}

#[test]
fn what_kvepp_sends_decodes_in_envoys_types_to_the_same_values() {
    for w in our_responses() {
        let bytes = w.encode_to_vec();
        let decoded = envoy::ProcessingResponse::decode(bytes.as_slice());
        assert_eq!(decoded.as_ref().ok(), Some(&as_envoys(&w)), "{w:?}");
        // And the same bytes as Envoy's types would write them.
        assert_eq!(as_envoys(&w).encode_to_vec(), bytes, "{w:?}");
    }
}

#[test]
fn a_decoded_body_is_a_slice_of_the_message_buffer() {
    let body = vec![b'x'; 256 << 10];
    let msg = envoy::ProcessingRequest {
        request: Some(envoy::processing_request::Request::RequestBody(envoy_body(
            &body, true,
        ))),
        ..Default::default()
    };
    let encoded = msg.encode_to_vec();
    // tonic decodes from its `BytesMut` read buffer (through a `Buf` that forwards
    // `copy_to_bytes` to it); a frozen `Bytes` is the other buffer prost reads.
    let mut read_buffer = bytes::BytesMut::from(encoded.as_slice());
    let frozen = Bytes::from(encoded.clone());
    let cases = [
        (
            read_buffer.as_ptr_range(),
            ProcessingRequest::decode(&mut read_buffer),
        ),
        (
            frozen.as_ptr_range(),
            ProcessingRequest::decode(frozen.clone()),
        ),
    ];
    for (range, decoded) in cases {
        let Ok(ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(b)),
            ..
        }) = decoded
        else {
            panic!("not a request body: {decoded:?}");
        };
        assert_eq!(b.body, body);
        assert!(
            range.contains(&b.body.as_ptr()),
            "the body was copied out of the message buffer"
        );
    }
}
