//! The framed answers against prost's own encoding of each message, and the body chunk sent
//! from where it lies.

use bytes::Bytes;
use envoy_types::pb::google::protobuf::Struct;
use http_body_util::BodyExt;
use prost::Message;
use tonic::Status;

use super::*;
use crate::wire::tests::{a_struct, header_map, mutation};
use crate::wire::{
    body_mutation, processing_response::Response, BodyMutation, BodyResponse, CommonResponse,
    HeadersResponse, ProcessingResponse, StreamedBodyResponse,
};

/// What a client reads: each data frame, then the trailers.
struct Read {
    frames: Vec<Bytes>,
    trailers: http::HeaderMap,
}

async fn framed(answers: Vec<Result<ProcessingResponse, Status>>, limit: usize) -> Read {
    let mut body = ResponseBody::new(futures::stream::iter(answers), limit);
    let mut frames = Vec::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("a frame");
        match frame.into_data() {
            Ok(data) => {
                assert!(trailers.is_none(), "data after the trailers");
                frames.push(data);
            }
            Err(frame) => trailers = Some(frame.into_trailers().expect("trailers")),
        }
    }
    assert!(http_body::Body::is_end_stream(&body));
    Read {
        frames,
        trailers: trailers.expect("trailers at the end"),
    }
}

/// `msgs` as gRPC frames the simple way: prost's whole encoding behind each prefix.
fn reference(msgs: &[ProcessingResponse]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in msgs {
        let bytes = m.encode_to_vec();
        out.push(0);
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}

fn joined(frames: &[Bytes]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        out.extend_from_slice(f);
    }
    out
}

/// The trailers' status, decoded as a gRPC client reads it.
fn status_of(trailers: &http::HeaderMap) -> (tonic::Code, String) {
    let status = Status::from_header_map(trailers).expect("grpc-status in the trailers");
    (status.code(), status.message().to_owned())
}

fn body_of(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

fn metadata() -> Struct {
    a_struct("envoy.lb", "10.0.0.1:8000")
}

/// One answer carrying `body` in each shape the framing splits, with the other fields on or off
/// as the bits of `fields` say.
fn answer(body: Bytes, fields: u32) -> ProcessingResponse {
    let on = |bit: u32| fields & (1 << bit) != 0;
    let mutation_kind = if on(0) {
        body_mutation::Mutation::Body(body)
    } else {
        body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
            body,
            end_of_stream: on(1),
        })
    };
    let answer = BodyResponse {
        response: Some(CommonResponse {
            status: i32::from(on(2)),
            header_mutation: on(3).then(mutation),
            body_mutation: Some(BodyMutation {
                mutation: Some(mutation_kind),
            }),
            trailers: on(4).then(|| header_map(&[("x-trailer", "1")])),
            clear_route_cache: on(5),
        }),
    };
    ProcessingResponse {
        response: Some(if on(6) {
            Response::ResponseBody(answer)
        } else {
            Response::RequestBody(answer)
        }),
        dynamic_metadata: on(7).then(metadata),
    }
}

/// Every combination of fields, with bodies at the edges of each varint length class and of
/// the by-reference threshold: the frames joined are prost's encoding, byte for byte, and a
/// long body is its own frame, the same memory as the answer's.
#[tokio::test]
async fn framed_answers_are_prosts_encoding_with_long_bodies_sent_in_place() {
    let lengths = [
        1,
        127,
        128,
        BY_REFERENCE - 1,
        BY_REFERENCE,
        16_383,
        16_384,
        (1 << 21) - 1,
        1 << 21,
    ];
    for &len in &lengths {
        let body = body_of(len, len as u8);
        for fields in 0..256u32 {
            let msgs = vec![answer(body.clone(), fields)];
            let read = framed(msgs.iter().cloned().map(Ok).collect(), usize::MAX).await;
            assert_eq!(
                joined(&read.frames),
                reference(&msgs),
                "body of {len} bytes, fields {fields:#b}"
            );
            assert_eq!(status_of(&read.trailers).0, tonic::Code::Ok);
            let in_place = read.frames.iter().any(|f| f.as_ptr() == body.as_ptr());
            assert_eq!(
                in_place,
                len >= BY_REFERENCE,
                "{len} bytes, fields {fields:#b}"
            );
            if in_place {
                assert!(
                    read.frames.iter().all(|f| f.len() < 256 || f.len() == len),
                    "only the body is a long frame"
                );
            }
        }
    }
}

/// A conversation's answers as the stream sends them: headers, then body chunks (some long),
/// then a headers answer on the response path. Small answers ready together share a frame.
#[tokio::test]
async fn a_stream_of_answers_is_framed_in_order_and_small_ones_share_a_frame() {
    let headers = ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation()),
                clear_route_cache: true,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(metadata()),
    };
    let msgs = vec![
        headers.clone(),
        request_body_chunk(body_of(100_000, 1), false),
        request_body_chunk(body_of(10, 2), false),
        request_body_chunk(body_of(70_000, 3), true),
        response_headers_continue(),
        response_body_continue(),
    ];
    let read = framed(msgs.iter().cloned().map(Ok).collect(), usize::MAX).await;
    assert_eq!(joined(&read.frames), reference(&msgs));
    assert_eq!(status_of(&read.trailers).0, tonic::Code::Ok);
    // The headers and the first chunk's head | its body | the short chunk and the next head |
    // its body | its tail and the last two answers.
    let lens: Vec<usize> = read.frames.iter().map(Bytes::len).collect();
    assert_eq!(lens.len(), 5, "{lens:?}");
    assert_eq!((lens[1], lens[3]), (100_000, 70_000), "{lens:?}");

    let small = vec![headers.clone(), headers];
    let read = framed(small.iter().cloned().map(Ok).collect(), usize::MAX).await;
    assert_eq!(
        read.frames.len(),
        1,
        "two small answers ready together: one frame"
    );
    assert_eq!(joined(&read.frames), reference(&small));
}

/// An answer over the limit is not sent: the answers before it are, then the stream ends with
/// `OUT_OF_RANGE` (tonic's encoder's code and words), whether or not it carries a long body.
#[tokio::test]
async fn an_answer_over_the_limit_ends_the_stream_with_out_of_range() {
    let before = response_headers_continue();
    for body_len in [100, 50_000] {
        let over = request_body_chunk(body_of(body_len, 0), true);
        let limit = over.encoded_len() - 1;
        let read = framed(
            vec![Ok(before.clone()), Ok(over.clone()), Ok(before.clone())],
            limit,
        )
        .await;
        assert_eq!(
            joined(&read.frames),
            reference(std::slice::from_ref(&before))
        );
        let (code, message) = status_of(&read.trailers);
        assert_eq!(code, tonic::Code::OutOfRange);
        assert!(
            message.contains(&format!("found {} bytes", over.encoded_len())),
            "{message}"
        );
        // At the limit it goes.
        let read = framed(vec![Ok(over.clone())], limit + 1).await;
        assert_eq!(joined(&read.frames), reference(&[over]));
    }
}

/// A status the answers end with becomes the trailers, after the answers before it.
#[tokio::test]
async fn a_stream_that_fails_ends_with_its_status() {
    let first = request_body_chunk(body_of(9_000, 4), false);
    let read = framed(
        vec![
            Ok(first.clone()),
            Err(Status::aborted(
                "ext_proc stream failed before a routing decision: x",
            )),
        ],
        usize::MAX,
    )
    .await;
    assert_eq!(joined(&read.frames), reference(&[first]));
    assert_eq!(
        status_of(&read.trailers),
        (
            tonic::Code::Aborted,
            "ext_proc stream failed before a routing decision: x".to_owned()
        )
    );
}

/// A body chunk sent back in FULL_DUPLEX_STREAMED mode, as the server's answers carry it.
fn request_body_chunk(body: Bytes, end_of_stream: bool) -> ProcessingResponse {
    let mutation = body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
        body,
        end_of_stream,
    });
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(mutation),
                }),
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

fn response_headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..Default::default()
    }
}

fn response_body_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse::default())),
        ..Default::default()
    }
}
