//! The ext_proc protocol driven directly with a tonic client: every answer kvepp can give.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request as Req,
    processing_response::Response as Resp, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvepp_test_support::prelude::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const BUFFERED: i32 = 2;
const DUPLEX: i32 = 4;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// Three endpoints that need not exist: the gRPC tests never forward traffic.
fn manifests() -> String {
    pool_manifests(&[
        ("s0", addr("10.0.0.1:8000")),
        ("s1", addr("10.0.0.2:8000")),
        ("s2", addr("10.0.0.3:8000")),
    ])
}

struct Session {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Session {
    async fn open(epp: &Epp) -> Session {
        let mut client =
            ExternalProcessorClient::<Channel>::connect(format!("http://{}", epp.grpc))
                .await
                .expect("connect");
        let (tx, rx) = mpsc::channel(64);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("process")
            .into_inner();
        Session { tx, rx }
    }

    async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.expect("send");
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(DEADLINE, self.rx.message())
            .await
            .expect("answer in time")
            .expect("stream ok")
            .expect("an answer")
    }

    /// The request body streamed back, chunk by chunk, up to the chunk with end_of_stream.
    async fn streamed_body(&mut self) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        loop {
            let (bytes, eos) = chunk(&self.recv().await);
            got.push(bytes);
            if eos {
                return got;
            }
        }
    }

    /// Asserts nothing arrives for a short while (used only to check a held answer stays held;
    /// a late answer would make the next `recv` see the wrong message anyway).
    async fn nothing_yet(&mut self) {
        let r = tokio::time::timeout(Duration::from_millis(100), self.rx.message()).await;
        assert!(r.is_err(), "unexpected answer: {r:?}");
    }
}

fn metadata_with(ns: &str, key: &str, v: Value) -> Metadata {
    let mut inner = Struct::default();
    inner.fields.insert(key.into(), v);
    let mut md = Metadata::default();
    md.filter_metadata.insert(ns.into(), inner);
    md
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn subset(list: &[&str]) -> Metadata {
    let values = list.iter().map(|s| string(s)).collect();
    metadata_with(
        "envoy.lb.subset_hint",
        "x-gateway-destination-endpoint-subset",
        Value {
            kind: Some(Kind::ListValue(ListValue { values })),
        },
    )
}

fn headers(mode: i32, end_of_stream: bool, md: Option<Metadata>) -> ProcessingRequest {
    headers_framed(mode, end_of_stream, md, true)
}

/// Request headers as Envoy sends them; `content_length` says whether the client framed the body
/// with Content-Length (else it is chunked).
fn headers_framed(
    mode: i32,
    end_of_stream: bool,
    md: Option<Metadata>,
    content_length: bool,
) -> ProcessingRequest {
    let mut list = vec![
        HeaderValue {
            key: ":method".into(),
            raw_value: b"POST".to_vec(),
            ..Default::default()
        },
        HeaderValue {
            key: ":path".into(),
            raw_value: b"/v1/completions".to_vec(),
            ..Default::default()
        },
        HeaderValue {
            key: "x-gateway-destination-endpoint".into(),
            raw_value: b"6.6.6.6:1".to_vec(),
            ..Default::default()
        },
    ];
    if content_length {
        list.push(HeaderValue {
            key: "content-length".into(),
            raw_value: b"123".to_vec(),
            ..Default::default()
        });
    }
    let h = HttpHeaders {
        headers: Some(HeaderMap { headers: list }),
        end_of_stream,
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(Req::RequestHeaders(h)),
        metadata_context: md,
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: DUPLEX,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Req::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(status: &str, served: Option<&str>) -> ProcessingRequest {
    let h = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":status".into(),
                raw_value: status.as_bytes().to_vec(),
                ..Default::default()
            }],
        }),
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(Req::ResponseHeaders(h)),
        metadata_context: served.map(|s| {
            metadata_with(
                "envoy.lb",
                "x-gateway-destination-endpoint-served",
                string(s),
            )
        }),
        ..Default::default()
    }
}

fn response_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Req::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// What a routing answer says.
#[derive(Debug)]
struct Routed {
    header: String,
    content_length: Option<String>,
    meta_primary: String,
    meta_fallback: Option<String>,
    replaced_body: Option<Vec<u8>>,
}

fn routed(r: &ProcessingResponse) -> Routed {
    let common = match r.response.as_ref().expect("response") {
        Resp::RequestHeaders(h) => h.response.clone(),
        Resp::RequestBody(b) => b.response.clone(),
        other => panic!("not a routing answer: {other:?}"),
    }
    .expect("common response");
    let set = common.header_mutation.expect("header mutation").set_headers;
    let get = |k: &str| {
        set.iter()
            .find(|h| h.header.as_ref().unwrap().key == k)
            .map(|h| {
                let hv = h.header.as_ref().unwrap();
                assert!(hv.value.is_empty(), "values travel in raw_value");
                assert_eq!(
                    h.append_action, 2,
                    "OVERWRITE_IF_EXISTS_OR_ADD: the client's own header is replaced"
                );
                String::from_utf8(hv.raw_value.clone()).unwrap()
            })
    };
    let lb = match &r
        .dynamic_metadata
        .as_ref()
        .expect("dynamic metadata")
        .fields["envoy.lb"]
        .kind
    {
        Some(Kind::StructValue(s)) => s.clone(),
        other => panic!("envoy.lb not a struct: {other:?}"),
    };
    let s = |k: &str| match lb.fields.get(k).and_then(|v| v.kind.clone()) {
        Some(Kind::StringValue(s)) => Some(s),
        None => None,
        other => panic!("{k}: {other:?}"),
    };
    let replaced_body = match common.body_mutation.and_then(|b| b.mutation) {
        Some(Mutation::Body(b)) => Some(b),
        None => None,
        other => panic!("unexpected body mutation {other:?}"),
    };
    Routed {
        header: get("x-gateway-destination-endpoint").expect("destination header"),
        content_length: get("content-length"),
        meta_primary: s("x-gateway-destination-endpoint").expect("metadata primary"),
        meta_fallback: s("x-gateway-destination-endpoint-fallback"),
        replaced_body,
    }
}

fn immediate_status(r: &ProcessingResponse) -> (u16, serde_json::Value) {
    match r.response.as_ref() {
        Some(Resp::ImmediateResponse(i)) => {
            let ct = &i.headers.as_ref().unwrap().set_headers[0]
                .header
                .as_ref()
                .unwrap();
            assert_eq!(
                (ct.key.as_str(), ct.raw_value.as_slice()),
                ("content-type", &b"application/json"[..])
            );
            let json: serde_json::Value = serde_json::from_slice(&i.body).expect("JSON error body");
            (i.status.as_ref().unwrap().code as u16, json)
        }
        other => panic!("not an immediate response: {other:?}"),
    }
}

/// Streamed chunk sent back: (bytes, end_of_stream).
fn chunk(r: &ProcessingResponse) -> (Vec<u8>, bool) {
    match r.response.as_ref() {
        Some(Resp::RequestBody(b)) => match b
            .response
            .clone()
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
        {
            Some(Mutation::StreamedResponse(s)) => (s.body, s.end_of_stream),
            other => panic!("not a streamed chunk: {other:?}"),
        },
        other => panic!("not a body answer: {other:?}"),
    }
}

async fn buffered_request(epp: &Epp, md: Option<Metadata>, payload: &[u8]) -> ProcessingResponse {
    let mut s = Session::open(epp).await;
    s.send(headers(BUFFERED, false, md)).await;
    let first = s.recv().await;
    assert!(
        matches!(first.response, Some(Resp::RequestHeaders(_))),
        "headers continue first: {first:?}"
    );
    s.send(body(payload, true)).await;
    s.recv().await
}

#[tokio::test]
async fn buffered_pick_header_equals_metadata_and_fallback_differs() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let pool = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    for _ in 0..10 {
        let r = routed(&buffered_request(&epp, None, br#"{"model":"m","prompt":"hello"}"#).await);
        assert_eq!(r.header, r.meta_primary, "header and metadata must agree");
        assert!(pool.contains(&r.header.as_str()), "{r:?}");
        let fb = r
            .meta_fallback
            .clone()
            .expect("fallback with three endpoints");
        assert!(pool.contains(&fb.as_str()) && fb != r.header, "{r:?}");
        assert!(
            r.replaced_body.is_none() && r.content_length.is_none(),
            "no rewrite, body untouched"
        );
    }
    epp.stop().await;
}

#[tokio::test]
async fn ordered_list_form_in_header_and_metadata() {
    let epp = Epp::start(&manifests(), |c| c.destination_endpoint_list = true).await;
    let r = routed(&buffered_request(&epp, None, br#"{"model":"m"}"#).await);
    let parts: Vec<&str> = r.header.split(',').collect();
    assert_eq!(parts.len(), 2, "{r:?}");
    assert_ne!(parts[0], parts[1]);
    assert_eq!(r.header, r.meta_primary);
    assert_eq!(Some(parts[1]), r.meta_fallback.as_deref());
    epp.stop().await;
}

#[tokio::test]
async fn buffered_rewrite_changes_only_model_and_sets_length() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let payload = br#"{ "prompt": "caf\u00e9 \u2603", "model" : "rw", "max_tokens": 5 }"#;
    let r = routed(&buffered_request(&epp, None, payload).await);
    let expected = br#"{ "prompt": "caf\u00e9 \u2603", "model" : "rw-target", "max_tokens": 5 }"#;
    assert_eq!(r.replaced_body.as_deref(), Some(&expected[..]));
    assert_eq!(r.content_length, Some(expected.len().to_string()));
    epp.stop().await;
}

#[tokio::test]
async fn duplex_split_at_awkward_points_is_returned_unchanged() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let payload = "{\"prompt\":\"naïve café ☃ — 𝄞 end\",\"model\":\"m\",\"n\":1}".as_bytes();
    // Cut inside the multi-byte chars, inside the "model" key and inside its string value.
    let mut cuts: Vec<usize> = vec![1, 14, 15, 23, 24, 33, 34, 36];
    let key = payload.windows(7).position(|w| w == b"\"model\"").unwrap();
    cuts.extend([key + 3, key + 11]);
    cuts.sort();
    cuts.dedup();
    let mut s = Session::open(&epp).await;
    s.send(headers(DUPLEX, false, None)).await;
    let mut prev = 0;
    for c in cuts.iter().copied().chain([payload.len()]) {
        s.send(body(&payload[prev..c], c == payload.len())).await;
        if c != payload.len() {
            // The headers answer is held until the whole body is there.
            s.nothing_yet().await;
        }
        prev = c;
    }
    let r = routed(&s.recv().await);
    assert_eq!(r.header, r.meta_primary);
    assert_eq!(
        r.content_length, None,
        "unchanged body: the client's framing stays"
    );
    let got = s.streamed_body().await;
    assert_eq!(
        got.concat(),
        payload,
        "streamed body comes back byte-identical"
    );
    // … in the very chunks the proxy sent (moved back, not re-cut or copied).
    let mut sent = Vec::new();
    let mut prev = 0;
    for c in cuts.iter().copied().chain([payload.len()]) {
        sent.push(payload[prev..c].to_vec());
        prev = c;
    }
    assert_eq!(got, sent);
    epp.stop().await;
}

#[tokio::test]
async fn duplex_rewrite_and_large_body_chunked_back() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let prompt = "x".repeat(300_000);
    let payload = format!("{{\"model\":\"rw\",\"prompt\":\"{prompt}\"}}");
    let expected = format!("{{\"model\":\"rw-target\",\"prompt\":\"{prompt}\"}}");
    let mut s = Session::open(&epp).await;
    s.send(headers(DUPLEX, false, None)).await;
    for piece in payload.as_bytes().chunks(50_000) {
        s.send(body(piece, false)).await;
    }
    s.send(body(b"", true)).await; // Envoy may end with an empty chunk.
    let r = routed(&s.recv().await);
    assert_eq!(r.content_length, Some(expected.len().to_string()));
    let got = s.streamed_body().await;
    assert!(
        got.iter().all(|c| c.len() <= 64 * 1024),
        "rewritten chunks stay within 64 KiB when the proxy sent smaller ones"
    );
    assert_eq!(got.concat(), expected.as_bytes());
    epp.stop().await;
}

#[tokio::test]
async fn duplex_with_trailers_ends_the_body() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let mut s = Session::open(&epp).await;
    s.send(headers(DUPLEX, false, None)).await;
    s.send(body(br#"{"model":"m"}"#, false)).await;
    s.send(ProcessingRequest {
        request: Some(Req::RequestTrailers(HttpTrailers::default())),
        ..Default::default()
    })
    .await;
    routed(&s.recv().await);
    let (bytes, eos) = chunk(&s.recv().await);
    assert_eq!(
        (bytes.as_slice(), eos),
        (&br#"{"model":"m"}"#[..], false),
        "trailers follow, so no end_of_stream on the body"
    );
    assert!(matches!(
        s.recv().await.response,
        Some(Resp::RequestTrailers(_))
    ));
    epp.stop().await;
}

#[tokio::test]
async fn no_body_request_is_routed_at_the_headers() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let mut s = Session::open(&epp).await;
    s.send(headers(DUPLEX, true, None)).await;
    let r = routed(&s.recv().await);
    assert_eq!(r.header, r.meta_primary);
    epp.stop().await;
}

#[tokio::test]
async fn status_codes() {
    let epp = Epp::start(&manifests(), |c| c.max_body_bytes = 4096).await;
    let cases: Vec<(&[u8], u16, &str)> = vec![
        (b"{\"model\":", 400, "not valid JSON"),
        (b"[]", 400, "JSON object"),
        (b"{\"prompt\":\"x\"}", 400, "no \\\"model\\\""),
        (b"{\"model\":42}", 400, "non-empty string"),
        (b"{\"model\":\"unknown-model\"}", 404, "unknown-model"),
    ];
    for (payload, code, needle) in cases {
        let (status, json) = immediate_status(&buffered_request(&epp, None, payload).await);
        assert_eq!(status, code, "{}", String::from_utf8_lossy(payload));
        assert_eq!(json["error"]["code"], code);
        let msg = json["error"]["message"].to_string();
        assert!(msg.contains(needle), "{msg} should mention {needle}");
    }
    // Subset: none of the hinted endpoints is in the pool, or the hint is empty → 503.
    for hint in [&["10.9.9.9:8000"][..], &[]] {
        let (status, _) = immediate_status(
            &buffered_request(&epp, Some(subset(hint)), br#"{"model":"m"}"#).await,
        );
        assert_eq!(status, 503, "subset {hint:?}");
    }
    // Oversized streamed body → 413 before the end of the body.
    let mut s = Session::open(&epp).await;
    s.send(headers(DUPLEX, false, None)).await;
    s.send(body(&[b' '; 3000], false)).await;
    s.send(body(&[b' '; 3000], false)).await;
    let (status, json) = immediate_status(&s.recv().await);
    assert_eq!(status, 413);
    assert!(json["error"]["message"].as_str().unwrap().contains("4096"));
    // The rejections are counted by reason.
    assert_eq!(
        epp.metric("kvepp_rejected_requests_total{reason=\"unknown_model\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        epp.metric("kvepp_rejected_requests_total{reason=\"subset_no_match\"}")
            .await,
        Some(2.0)
    );
    epp.stop().await;
}

#[tokio::test]
async fn subset_partial_match_picks_only_from_it() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    for _ in 0..10 {
        let hint = subset(&["10.0.0.2:8000", "10.9.9.9:1", "not-an-address"]);
        let r = routed(&buffered_request(&epp, Some(hint), br#"{"model":"m"}"#).await);
        assert_eq!(r.header, "10.0.0.2:8000");
        assert_eq!(
            r.meta_fallback, None,
            "the only eligible endpoint has no fallback"
        );
    }
    epp.stop().await;
}

#[tokio::test]
async fn pass_through_and_pool_without_endpoints() {
    let epp = Epp::start(&manifests(), |c| {
        c.unknown_models = kvepp::config::UnknownModels::PassThrough
    })
    .await;
    routed(&buffered_request(&epp, None, br#"{"model":"anything"}"#).await);
    epp.stop().await;

    let no_ready = format!(
        "{}{}{}",
        pool_yaml("pool"),
        standard_models(),
        slice_yaml("s", addr("10.0.0.1:8000"), false)
    );
    let epp = Epp::start(&no_ready, |_| {}).await;
    let (status, json) = immediate_status(&buffered_request(&epp, None, br#"{"model":"m"}"#).await);
    assert_eq!(status, 503);
    assert!(json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no ready endpoints"));
    assert_eq!(epp.metric("kvepp_ready_endpoints").await, Some(0.0));
    epp.stop().await;
}

/// In-flight accounting through the response path: admitted → first byte → end of stream or abort,
/// observed through what it drives (shedding of Sheddable requests).
#[tokio::test]
async fn sheddable_429_follows_in_flight_accounting() {
    let one = format!(
        "{}{}{}",
        pool_yaml("pool"),
        standard_models(),
        slice_yaml("s", addr("10.0.0.1:8000"), true)
    );
    let epp = Epp::start(&one, |c| c.max_in_flight_per_endpoint = 1).await;
    let shed = br#"{"model":"shed"}"#;
    // A Critical request in flight saturates the single endpoint.
    let mut s = Session::open(&epp).await;
    s.send(headers(BUFFERED, false, None)).await;
    s.recv().await;
    s.send(body(br#"{"model":"crit"}"#, true)).await;
    routed(&s.recv().await);
    assert_eq!(epp.metric("kvepp_in_flight_requests").await, Some(1.0));
    let (status, json) = immediate_status(&buffered_request(&epp, None, shed).await);
    assert_eq!(
        (status, json["error"]["type"].as_str()),
        (429, Some("rate_limit_error"))
    );
    // Standard and Critical requests are still routed.
    routed(&buffered_request(&epp, None, br#"{"model":"m"}"#).await);
    // Response starts: still in flight.
    s.send(response_headers("200", None)).await;
    assert!(matches!(
        s.recv().await.response,
        Some(Resp::ResponseHeaders(_))
    ));
    s.send(response_body(b"data: {}\n\n", false)).await;
    s.recv().await;
    assert_eq!(
        immediate_status(&buffered_request(&epp, None, shed).await).0,
        429
    );
    // End of stream releases the slot.
    s.send(response_body(b"data: [DONE]\n\n", true)).await;
    let echoed = s.recv().await;
    match echoed.response {
        Some(Resp::ResponseBody(b)) => match b
            .response
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
        {
            Some(Mutation::StreamedResponse(sb)) => assert_eq!(
                (sb.body.as_slice(), sb.end_of_stream),
                (&b"data: [DONE]\n\n"[..], true)
            ),
            other => panic!("response chunk not echoed: {other:?}"),
        },
        other => panic!("{other:?}"),
    }
    wait_for("slot released at end of stream", || async {
        (epp.metric("kvepp_in_flight_requests").await == Some(0.0)).then_some(())
    })
    .await;
    routed(&buffered_request(&epp, None, shed).await);
    drop(s);
    let crit_ok = "kvepp_requests_total{model=\"crit\",target_model=\"crit\",endpoint=\"10.0.0.1:8000\",code=\"200\"}";
    wait_for("completed request counted with its status", || async {
        (epp.metric(crit_ok).await == Some(1.0)).then_some(())
    })
    .await;

    // Abort: the proxy drops the stream mid-request; the slot comes back too.
    let mut s = Session::open(&epp).await;
    s.send(headers(BUFFERED, false, None)).await;
    s.recv().await;
    s.send(body(br#"{"model":"crit"}"#, true)).await;
    routed(&s.recv().await);
    assert_eq!(
        immediate_status(&buffered_request(&epp, None, shed).await).0,
        429
    );
    drop(s);
    wait_for("slot released on abort", || async {
        (epp.metric("kvepp_in_flight_requests").await == Some(0.0)).then_some(())
    })
    .await;
    routed(&buffered_request(&epp, None, shed).await);
    let text = epp.metrics_text().await;
    assert!(text.contains("kvepp_requests_total{model=\"crit\",target_model=\"crit\",endpoint=\"10.0.0.1:8000\",code=\"no_response\"} 1"), "{text}");
    assert!(text.contains("kvepp_requests_total{model=\"shed\",target_model=\"shed\",endpoint=\"\",code=\"429\"} 3"), "{text}");
    epp.stop().await;
}

#[tokio::test]
async fn served_endpoint_reported_by_the_proxy_moves_the_booking() {
    let two = format!(
        "{}{}{}{}",
        pool_yaml("pool"),
        standard_models(),
        slice_yaml("a", addr("10.0.0.1:8000"), true),
        slice_yaml("b", addr("10.0.0.2:8000"), true)
    );
    let epp = Epp::start(&two, |_| {}).await;
    let mut s = Session::open(&epp).await;
    s.send(headers(BUFFERED, false, None)).await;
    s.recv().await;
    s.send(body(br#"{"model":"m"}"#, true)).await;
    let r = routed(&s.recv().await);
    let fallback = r.meta_fallback.clone().expect("fallback");
    s.send(response_headers("200", Some(&fallback))).await;
    s.recv().await;
    s.send(response_body(b"{}", true)).await;
    s.recv().await;
    drop(s);
    wait_for("request counted on the served endpoint", || {
        let series = format!("kvepp_requests_total{{model=\"m\",target_model=\"m\",endpoint=\"{fallback}\",code=\"200\"}}");
        let epp = &epp;
        async move { (epp.metric(&series).await == Some(1.0)).then_some(()) }
    })
    .await;
    assert_eq!(epp.metric("kvepp_served_elsewhere_total").await, Some(1.0));
    epp.stop().await;
}

#[tokio::test]
async fn unsupported_streamed_mode_is_refused_clearly() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let mut s = Session::open(&epp).await;
    s.send(headers(1, false, None)).await;
    let (status, json) = immediate_status(&s.recv().await);
    assert_eq!(status, 500);
    assert!(json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("FULL_DUPLEX_STREAMED"));
    epp.stop().await;
}

#[tokio::test]
async fn manifest_edits_apply_and_broken_files_keep_last_good_state() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    epp.write_manifest("pool.yaml", "this: is: not: yaml: [");
    // Still routing with the last good state.
    routed(&buffered_request(&epp, None, br#"{"model":"m"}"#).await);
    wait_for("parse error counted", || async {
        (epp.metric("kvepp_manifest_errors_total").await == Some(1.0)).then_some(())
    })
    .await;
    // A fixed file with only one endpoint and the model removed.
    let one = format!(
        "{}{}{}",
        pool_yaml("pool"),
        model_yaml("other", "Standard", &[]),
        slice_yaml("s", addr("10.0.0.3:8000"), true)
    );
    epp.write_manifest("pool.yaml", &one);
    wait_for("model m removed", || async {
        let r = buffered_request(&epp, None, br#"{"model":"m"}"#).await;
        matches!(r.response, Some(Resp::ImmediateResponse(_))).then_some(())
    })
    .await;
    let r = routed(&buffered_request(&epp, None, br#"{"model":"other"}"#).await);
    assert_eq!(r.header, "10.0.0.3:8000");
    epp.stop().await;
}

/// Streamed mode: an unchanged body keeps the client's framing (Envoy preserves it), so kvepp sends
/// no Content-Length; a rewritten body gets its new length whatever the client sent.
#[tokio::test]
async fn streamed_content_length_only_for_rewrites() {
    async fn cl(epp: &Epp, client_cl: bool, payload: &[u8]) -> Option<String> {
        let mut s = Session::open(epp).await;
        s.send(headers_framed(DUPLEX, false, None, client_cl)).await;
        s.send(body(payload, true)).await;
        routed(&s.recv().await).content_length
    }
    let epp = Epp::start(&manifests(), |_| {}).await;
    let plain = br#"{"model":"m"}"#;
    let new_len = Some(br#"{"model":"rw-target"}"#.len().to_string());
    for client_cl in [true, false] {
        assert_eq!(cl(&epp, client_cl, plain).await, None);
        assert_eq!(cl(&epp, client_cl, br#"{"model":"rw"}"#).await, new_len);
    }
    epp.stop().await;
}

/// Right after a start the pool may not be loaded: a stream waits (up to `startup_wait_ms`) and is
/// routed once it is, instead of getting 503 at once; after the bound it gets the 503.
#[tokio::test]
async fn streams_wait_for_the_pool_after_a_start_then_503() {
    let slices: String = ["10.0.0.1:8000", "10.0.0.2:8000"]
        .iter()
        .enumerate()
        .map(|(i, a)| slice_yaml(&format!("s{i}"), addr(a), true))
        .collect();
    let epp = Epp::start_unready(&slices, |c| c.startup_wait_ms = 20_000).await;
    let mut s = Session::open(&epp).await;
    s.send(headers(BUFFERED, false, None)).await;
    // The InferencePool appears while the stream waits.
    epp.write_manifest(
        "pool.yaml",
        &(pool_yaml("pool") + &standard_models() + &slices),
    );
    let first = s.recv().await;
    assert!(matches!(first.response, Some(Resp::RequestHeaders(_))));
    s.send(body(br#"{"model":"m","prompt":"hi"}"#, true)).await;
    let r = routed(&s.recv().await);
    assert!(["10.0.0.1:8000", "10.0.0.2:8000"].contains(&r.header.as_str()));
    epp.stop().await;

    let epp = Epp::start_unready(&slices, |c| c.startup_wait_ms = 100).await;
    let (status, json) = immediate_status(&buffered_request(&epp, None, br#"{"model":"m"}"#).await);
    assert_eq!(status, 503);
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("not known yet"),
        "{json}"
    );
    epp.stop().await;
}

/// A method the ext_proc service does not have is answered UNIMPLEMENTED, naming the path.
#[tokio::test]
async fn an_unknown_method_is_unimplemented() {
    let epp = Epp::start(&manifests(), |_| {}).await;
    let channel = Channel::from_shared(format!("http://{}", epp.grpc))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.expect("ready");
    let path = "/envoy.service.ext_proc.v3.ExternalProcessor/Other";
    let answer = client
        .unary(
            tonic::Request::new(()),
            http::uri::PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::<(), ()>::default(),
        )
        .await;
    let status = answer.expect_err("no such method");
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    assert!(status.message().contains(path), "{status:?}");
}
