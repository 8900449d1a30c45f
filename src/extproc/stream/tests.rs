//! The stream state machine alone: messages in, responses out, with a fixed routing service (no
//! gRPC, no datastore).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::extproc::wire::{
    body_mutation::Mutation, processing_response::Response, HttpTrailers, ProtocolConfiguration,
};
use kvepp_core::{Endpoint, PrefixMode};

use super::*;
use crate::extproc::{Settings, Shared};
use crate::metrics::Metrics;
use crate::routing::{Prepared, RouteHints, RouteRequest, Routed, Verdict};
use kvepp_core::Admission;

const BUFFERED: i32 = 2;
const DUPLEX: i32 = 4;

/// Routes every request to one endpoint, or rejects every request.
#[derive(Debug)]
struct Fixed {
    ep: Arc<Endpoint>,
    reject: Option<Rejection>,
    /// The objectives (TTFT budget, TPOT) of the last decision's hints.
    budgets: parking_lot::Mutex<(Option<f64>, Option<f64>)>,
}

impl RouteRequest for Fixed {
    fn prepare(&self, body: Option<&Bytes>, head: &RequestHead<'_>) -> Result<Prepared, Rejection> {
        let objective = head.objective;
        if let Some(r) = &self.reject {
            return Err(r.clone());
        }
        // The objective header's value, when a number, is the priority.
        let priority = objective.and_then(|o| o.parse().ok()).unwrap_or(0);
        // `{"model":"rw12"}` gets its model value (bytes 9..15, quotes included) rewritten.
        let rewrite = body
            .filter(|b| b.starts_with(br#"{"model":"rw"#))
            .map(|_| (9..15, Arc::from("target-model")));
        Ok(Prepared {
            priority,
            served: None,
            prompt: None,
            rewrite,
            model_label: "m".into(),
            target_label: "m".into(),
            rewritten_by: None,
            prompt_tokens: 0,
            max_tokens: None,
        })
    }

    fn decide(&self, _: &Prepared, hints: &RouteHints<'_>) -> Result<Verdict, Rejection> {
        *self.budgets.lock() = (hints.ttft_budget_ms, hints.tpot_budget_ms);
        // Saturated while the endpoint has a request in flight.
        let busy = self.ep.load.in_flight() > 0;
        if busy && hints.admission == Admission::Unsaturated {
            return Ok(Verdict::Wait);
        }
        Ok(Verdict::Routed(Routed {
            session: None,
            pick: Pick {
                primary: self.ep.clone(),
                fallback: None,
                kv: None,
                scores: None,
                pairing: None,
                adapter: None,
                candidates: 1,
            },
            mode: PrefixMode::None,
            booking: self.ep.load.book(),
            repicks: 0,
        }))
    }

    fn endpoint(&self, addr: SocketAddr) -> Option<Arc<Endpoint>> {
        (addr == self.ep.addr).then(|| self.ep.clone())
    }

    fn has_capacity(&self) -> bool {
        self.ep.load.in_flight() == 0
    }
}

fn endpoint() -> Arc<Endpoint> {
    Arc::new(Endpoint::new(([10, 0, 0, 7], 8000).into(), "pod-7"))
}

fn stream(reject: Option<Rejection>, max_body_bytes: usize) -> (StreamState, Arc<Endpoint>) {
    let ep = endpoint();
    let routing: Arc<dyn RouteRequest> = Arc::new(Fixed {
        ep: ep.clone(),
        reject,
        budgets: Default::default(),
    });
    let shared = Shared::new(
        routing,
        Metrics::new(),
        Settings {
            destination_list: false,
            max_body_bytes,
            ready_wait: std::time::Duration::ZERO,
            endpoint_scores: false,
        },
    );
    (StreamState::new(Arc::new(shared)), ep)
}

fn headers(mode: i32, end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: 0,
            ..Default::default()
        }),
        request: Some(Msg::RequestHeaders(HttpHeaders {
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::RequestBody(HttpBody {
            body: Bytes::copy_from_slice(bytes),
            end_of_stream,
        })),
        ..Default::default()
    }
}

fn response_body(end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::ResponseBody(HttpBody {
            body: Bytes::from_static(b"data"),
            end_of_stream,
        })),
        ..Default::default()
    }
}

fn send(s: &mut StreamState, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
    let mut out = Vec::new();
    s.handle(msg, &mut out);
    out
}

/// The destination header set by a response, if any.
fn destination(r: &ProcessingResponse) -> Option<String> {
    let common = match r.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == resp::DESTINATION_HEADER)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}

fn immediate_status(r: &ProcessingResponse) -> Option<i32> {
    match r.response.as_ref()? {
        Response::ImmediateResponse(i) => i.status.as_ref().map(|s| s.code),
        _ => None,
    }
}

fn streamed_chunks(out: &[ProcessingResponse]) -> Vec<(Vec<u8>, bool)> {
    out.iter()
        .filter_map(|r| match r.response.as_ref()? {
            Response::RequestBody(b) => match b.response.as_ref()?.body_mutation.as_ref()?.mutation
            {
                Some(Mutation::StreamedResponse(ref s)) => Some((s.body.to_vec(), s.end_of_stream)),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn buffered_body_is_routed_in_the_body_answer_and_booked_until_the_response_ends() {
    let (mut s, ep) = stream(None, 1 << 20);
    let out = send(&mut s, headers(BUFFERED, false));
    assert_eq!(out.len(), 1);
    assert_eq!(destination(&out[0]), None, "headers continue unrouted");
    let out = send(&mut s, body(br#"{"model":"m","prompt":"hi"}"#, true));
    assert_eq!(out.len(), 1);
    assert_eq!(destination(&out[0]).as_deref(), Some("10.0.0.7:8000"));
    assert_eq!((ep.load.in_flight(), ep.load.waiting_first_byte()), (1, 1));
    assert_eq!(send(&mut s, response_body(false)).len(), 1);
    assert_eq!((ep.load.in_flight(), ep.load.waiting_first_byte()), (1, 0));
    send(&mut s, response_body(true));
    assert_eq!(
        ep.load.in_flight(),
        0,
        "released at the end of the response"
    );
}

#[test]
fn duplex_holds_the_headers_and_returns_the_chunks_it_was_sent() {
    let (mut s, ep) = stream(None, 1 << 20);
    assert!(
        send(&mut s, headers(DUPLEX, false)).is_empty(),
        "headers answer held"
    );
    assert!(send(&mut s, body(br#"{"model":"m","#, false)).is_empty());
    let out = send(&mut s, body(br#""prompt":"x"}"#, true));
    assert_eq!(destination(&out[0]).as_deref(), Some("10.0.0.7:8000"));
    assert_eq!(
        streamed_chunks(&out[1..]),
        vec![
            (br#"{"model":"m","#.to_vec(), false),
            (br#""prompt":"x"}"#.to_vec(), true)
        ]
    );
    assert_eq!(ep.load.in_flight(), 1);
    drop(s);
    assert_eq!(
        ep.load.in_flight(),
        0,
        "a stream that goes away releases its booking"
    );
}

#[test]
fn duplex_with_trailers_ends_the_body_at_the_trailers() {
    let (mut s, _ep) = stream(None, 1 << 20);
    send(&mut s, headers(DUPLEX, false));
    assert!(send(&mut s, body(br#"{"model":"m"}"#, false)).is_empty());
    let out = send(
        &mut s,
        ProcessingRequest {
            request: Some(Msg::RequestTrailers(HttpTrailers::default())),
            ..Default::default()
        },
    );
    assert_eq!(destination(&out[0]).as_deref(), Some("10.0.0.7:8000"));
    assert_eq!(
        streamed_chunks(&out),
        vec![(br#"{"model":"m"}"#.to_vec(), false)]
    );
    assert!(matches!(
        out.last().and_then(|r| r.response.as_ref()),
        Some(Response::RequestTrailers(_))
    ));
}

#[test]
fn rewritten_body_carries_its_new_length() {
    let (mut s, _ep) = stream(None, 1 << 20);
    send(&mut s, headers(DUPLEX, false));
    let out = send(&mut s, body(br#"{"model":"rw12"}"#, true));
    let chunks = streamed_chunks(&out);
    let sent: Vec<u8> = chunks.iter().flat_map(|(c, _)| c.clone()).collect();
    assert_eq!(sent, br#"{"model":"target-model"}"#.to_vec());
    let common = match out[0].response.as_ref() {
        Some(Response::RequestHeaders(h)) => h.response.clone().unwrap_or_default(),
        other => panic!("expected the headers answer, got {other:?}"),
    };
    let len = common
        .header_mutation
        .unwrap_or_default()
        .set_headers
        .into_iter()
        .filter_map(|h| h.header)
        .find(|h| h.key == "content-length")
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
    assert_eq!(len.as_deref(), Some("24"));
}

#[test]
fn rejections_become_immediate_responses_and_end_the_stream() {
    let (mut s, ep) = stream(Some(Rejection::new(429, "saturated", "all busy")), 1 << 20);
    send(&mut s, headers(BUFFERED, false));
    let out = send(&mut s, body(br#"{"model":"m"}"#, true));
    assert_eq!(out.len(), 1);
    assert_eq!(immediate_status(&out[0]), Some(429));
    assert!(
        send(&mut s, body(b"more", true)).is_empty(),
        "nothing after a rejection"
    );
    assert_eq!(ep.load.in_flight(), 0);
}

#[test]
fn oversized_bodies_get_413_in_both_modes() {
    let (mut s, ep) = stream(None, 1024);
    send(&mut s, headers(BUFFERED, false));
    let out = send(&mut s, body(&[b' '; 2000], true));
    assert_eq!(immediate_status(&out[0]), Some(413));

    let (mut s, _) = stream(None, 1024);
    send(&mut s, headers(DUPLEX, false));
    assert!(send(&mut s, body(&[b' '; 800], false)).is_empty());
    let out = send(&mut s, body(&[b' '; 800], false));
    assert_eq!(
        immediate_status(&out[0]),
        Some(413),
        "limit counted over chunks"
    );
    assert_eq!(ep.load.in_flight(), 0);
}

#[test]
fn unsupported_mode_and_header_time_picks() {
    let (mut s, _) = stream(None, 1024);
    let out = send(&mut s, headers(1, false)); // STREAMED
    assert_eq!(immediate_status(&out[0]), Some(500));

    // No body: routed at the headers.
    let (mut s, ep) = stream(None, 1024);
    let out = send(&mut s, headers(BUFFERED, true));
    assert_eq!(destination(&out[0]).as_deref(), Some("10.0.0.7:8000"));
    assert_eq!(ep.load.in_flight(), 1);
}

fn with_header(mut msg: ProcessingRequest, key: &str, value: &str) -> ProcessingRequest {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    if let Some(Msg::RequestHeaders(h)) = &mut msg.request {
        h.headers
            .get_or_insert_with(HeaderMap::default)
            .headers
            .push(HeaderValue {
                key: key.into(),
                raw_value: value.as_bytes().to_vec(),
                ..Default::default()
            });
    }
    msg
}

#[test]
fn slo_headers_become_the_decisions_objectives_and_a_bad_one_is_a_400() {
    let routing = Arc::new(Fixed {
        ep: endpoint(),
        reject: None,
        budgets: Default::default(),
    });
    let shared = Arc::new(Shared::new(
        routing.clone(),
        Metrics::new(),
        Settings {
            destination_list: false,
            max_body_bytes: 1024,
            ready_wait: std::time::Duration::ZERO,
            endpoint_scores: false,
        },
    ));
    let mut s = StreamState::new(shared.clone());
    let h = with_header(headers(BUFFERED, true), "x-slo-ttft-ms", "800");
    let out = send(&mut s, with_header(h, "x-slo-tpot-ms", "25"));
    assert_eq!(destination(&out[0]).as_deref(), Some("10.0.0.7:8000"));
    let (ttft, tpot) = *routing.budgets.lock();
    assert!(ttft.is_some_and(|b| b > 700.0 && b <= 800.0), "{ttft:?}");
    assert_eq!(tpot, Some(25.0));
    // Without them, no objective.
    let mut s = StreamState::new(shared.clone());
    send(&mut s, headers(BUFFERED, true));
    assert_eq!(*routing.budgets.lock(), (None, None));
    for bad in ["0", "fast", "-5"] {
        let mut s = StreamState::new(shared.clone());
        let out = send(
            &mut s,
            with_header(headers(BUFFERED, true), "x-slo-tpot-ms", bad),
        );
        assert_eq!(immediate_status(&out[0]), Some(400), "{bad}");
    }
}

fn with_objective(mut msg: ProcessingRequest, objective: &str) -> ProcessingRequest {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    if let Some(Msg::RequestHeaders(h)) = &mut msg.request {
        h.headers = Some(HeaderMap {
            headers: vec![HeaderValue {
                key: OBJECTIVE_HEADERS[0].into(),
                raw_value: objective.as_bytes().to_vec(),
                ..Default::default()
            }],
        });
    }
    msg
}

#[test]
fn with_flow_control_a_saturated_request_is_held_with_its_body_then_routed() {
    let ep = endpoint();
    let routing: Arc<dyn RouteRequest> = Arc::new(Fixed {
        ep: ep.clone(),
        reject: None,
        budgets: Default::default(),
    });
    let metrics = Metrics::new();
    let on = crate::admission::FlowControlSettings {
        enabled: true,
        ..Default::default()
    };
    let flow = crate::admission::FlowControl::new(on, Default::default());
    let settings = Settings {
        destination_list: false,
        max_body_bytes: 1 << 20,
        ready_wait: std::time::Duration::ZERO,
        endpoint_scores: false,
    };
    let shared = Arc::new(Shared::new(routing, metrics, settings).with_flow_control(flow));
    let busy = ep.load.book();
    let mut s = StreamState::new(shared);
    assert!(send(&mut s, with_objective(headers(DUPLEX, false), "7")).is_empty());
    assert!(send(&mut s, body(b"{\"model\":", false)).is_empty());
    assert!(
        send(&mut s, body(b"\"m\"}", true)).is_empty(),
        "held, not answered"
    );
    assert_eq!(s.queued(), Some(7), "queued at the objective's priority");
    assert!(s.undecided());
    // Still saturated: a turn that cannot place it leaves it queued.
    let mut out = Vec::new();
    s.retry(Admission::Unsaturated, &mut out);
    assert!(out.is_empty() && s.queued().is_some());
    drop(busy);
    s.retry(Admission::Unsaturated, &mut out);
    assert_eq!(s.queued(), None);
    assert_eq!(destination(&out[0]).as_deref(), Some("10.0.0.7:8000"));
    let chunks = streamed_chunks(&out);
    assert_eq!(
        chunks,
        vec![(b"{\"model\":".to_vec(), false), (b"\"m\"}".to_vec(), true)],
        "the body goes back as it came"
    );
    assert_eq!(ep.load.in_flight(), 1, "booked once placed");
    // Giving up on a queued request answers it; on a routed one it does nothing.
    s.give_up(Rejection::new(503, "queue_timeout", "late"), &mut out);
    assert_eq!(out.len(), 3);
}
