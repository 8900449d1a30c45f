//! The ext_proc messages that carry bodies, decoded and encoded by kvepp's own prost types so a
//! body is never copied on its way in or out.
//!
//! `envoy-types` generates `HttpBody.body` and `StreamedBodyResponse.body` as `Vec<u8>`: prost
//! copies every body chunk out of the gRPC message buffer into a fresh vector, and again into
//! the response. Here those fields are `bytes::Bytes`: decoding takes the chunk as a slice of
//! tonic's message buffer (`Buf::copy_to_bytes` on tonic's buffer splits it, it does not copy),
//! and a chunk sent back in FULL_DUPLEX_STREAMED mode is that same slice, written once into the
//! outgoing message. So a prompt is copied at most once on the request path: when a body that
//! came in several chunks is joined for parsing.
//!
//! Owns: the request and response envelopes ([`ProcessingRequest`], [`ProcessingResponse`]) and
//! the messages on the way to a body. Everything without a body (headers, trailers, metadata,
//! header mutations, immediate responses) is `envoy-types`' own type, nested as it is.
//!
//! Invariants: every field here has the name, number and wire type of Envoy's
//! `envoy/service/ext_proc/v3/external_processor.proto`; a test checks each against
//! `envoy-types` in both directions. Fields kvepp neither reads nor sends are left out: prost
//! skips them unread on decode (the request's `attributes`, `flow_control_init`,
//! `client_window_update`, and a body's flags beyond `end_of_stream`), which is less decoding,
//! not less meaning. Requests are decoded only, responses encoded only, by the server.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::google::protobuf::Struct;

pub use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeaderMutation, HttpHeaders, HttpTrailers, ImmediateResponse, ProtocolConfiguration,
    TrailersResponse,
};

/// What Envoy sends on an ext_proc stream: one phase of the HTTP request or response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "processing_request::Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<processing_request::Request>,
    /// Dynamic metadata Envoy forwards (`metadata_options`), e.g. the subset hint.
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    /// Envoy does not wait for answers in observability mode.
    #[prost(bool, tag = "10")]
    pub observability_mode: bool,
    /// The filter's processing modes, sent on the stream's first message.
    #[prost(message, optional, tag = "11")]
    pub protocol_config: Option<ProtocolConfiguration>,
}

pub mod processing_request {
    use super::{HttpBody, HttpHeaders, HttpTrailers};

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "2")]
        RequestHeaders(HttpHeaders),
        #[prost(message, tag = "3")]
        ResponseHeaders(HttpHeaders),
        #[prost(message, tag = "4")]
        RequestBody(HttpBody),
        #[prost(message, tag = "5")]
        ResponseBody(HttpBody),
        #[prost(message, tag = "6")]
        RequestTrailers(HttpTrailers),
        #[prost(message, tag = "7")]
        ResponseTrailers(HttpTrailers),
    }
}

/// A body, or one chunk of it: a slice of the gRPC message it came in.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// kvepp's answer to one [`ProcessingRequest`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "processing_response::Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<processing_response::Response>,
    /// Dynamic metadata set on the request (`envoy.lb` carries the destination).
    #[prost(message, optional, tag = "8")]
    pub dynamic_metadata: Option<Struct>,
}

pub mod processing_response {
    use super::{BodyResponse, HeadersResponse, ImmediateResponse, TrailersResponse};

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        RequestHeaders(HeadersResponse),
        #[prost(message, tag = "2")]
        ResponseHeaders(HeadersResponse),
        #[prost(message, tag = "3")]
        RequestBody(BodyResponse),
        #[prost(message, tag = "4")]
        ResponseBody(BodyResponse),
        #[prost(message, tag = "5")]
        RequestTrailers(TrailersResponse),
        #[prost(message, tag = "6")]
        ResponseTrailers(TrailersResponse),
        #[prost(message, tag = "7")]
        ImmediateResponse(ImmediateResponse),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// Mutations common to header and body answers.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    /// `CONTINUE` (0) or `CONTINUE_AND_REPLACE` (1).
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(message, optional, tag = "3")]
    pub body_mutation: Option<BodyMutation>,
    #[prost(message, optional, tag = "4")]
    pub trailers: Option<HeaderMap>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyMutation {
    #[prost(oneof = "body_mutation::Mutation", tags = "1, 2, 3")]
    pub mutation: Option<body_mutation::Mutation>,
}

pub mod body_mutation {
    use bytes::Bytes;

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Mutation {
        /// The whole new body (BUFFERED mode).
        #[prost(bytes = "bytes", tag = "1")]
        Body(Bytes),
        #[prost(bool, tag = "2")]
        ClearBody(bool),
        /// One chunk of the body (FULL_DUPLEX_STREAMED mode).
        #[prost(message, tag = "3")]
        StreamedResponse(super::StreamedBodyResponse),
    }
}

/// One chunk of a body sent back in FULL_DUPLEX_STREAMED mode.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamedBodyResponse {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

#[cfg(test)]
pub(crate) mod tests;
