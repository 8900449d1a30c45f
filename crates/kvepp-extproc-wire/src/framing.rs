//! The `Process` method's response body: each [`ProcessingResponse`] framed as a gRPC message
//! (a flag byte, a big-endian length, the protobuf), with the body chunk an answer carries back
//! passed on by reference instead of copied into the outgoing buffer.
//!
//! In FULL_DUPLEX_STREAMED mode every chunk of the request body goes back to Envoy in a
//! `StreamedBodyResponse`, so an encoder that writes whole messages into one buffer (tonic's)
//! copies the whole prompt once more on every request. Here such a message is written as three
//! parts: the bytes before its body (the gRPC prefix, the enclosing messages' keys and lengths),
//! the body itself (the very `Bytes` the request brought, a frame of its own that h2 writes from
//! where it lies), and the bytes after it. Everything else, and any body shorter than
//! [`BY_REFERENCE`], is encoded by prost as usual. Consecutive small parts share one buffer, so
//! a headers answer and a short body answer ready together go out as one frame, as with tonic.
//!
//! Owns: the response framing, the encoding limit (a message over it ends the stream with
//! `OUT_OF_RANGE`, as tonic's encoder does), and the trailers (`grpc-status` 0 at the end, or
//! the status an answer stream ended with).
//!
//! Invariant: the bytes sent for a message are exactly `[0, len as u32 BE] ++
//! msg.encode_to_vec()` (the tests: the parts joined, against prost's encoding, over the
//! field combinations and every length class of the body's varint).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use futures::Stream;
use http_body::Frame;
use prost::encoding::{self, encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use tonic::Status;

use crate::wire::body_mutation::Mutation;
use crate::wire::processing_response::Response;
use crate::wire::{CommonResponse, ProcessingResponse};

/// A body at least this long is sent by reference; a shorter one is copied with its message.
pub const BY_REFERENCE: usize = 4096;

/// Small parts are gathered up to this size before they go out as one frame.
const GATHER: usize = 32 * 1024;

/// gRPC's message prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// The stream of answers as an HTTP/2 response body (data frames, then trailers).
pub struct ResponseBody<S> {
    source: S,
    /// Largest encoded message sent.
    limit: usize,
    /// Encoded bytes not yet handed on.
    small: BytesMut,
    /// Frames ready to hand on, in order.
    ready: VecDeque<Bytes>,
    /// How the answers ended (`grpc-status` 0, or the status they ended with); the trailers
    /// follow the frames still ready.
    ended: Option<Status>,
    /// The trailers have been handed on.
    done: bool,
}

impl<S> ResponseBody<S> {
    /// Frames `source`'s answers, refusing any message over `limit` encoded bytes.
    pub fn new(source: S, limit: usize) -> Self {
        ResponseBody {
            source,
            limit,
            small: BytesMut::new(),
            ready: VecDeque::new(),
            ended: None,
            done: false,
        }
    }

    /// Encodes `msg` after what is gathered (an `OUT_OF_RANGE` status if it is over the limit).
    fn push(&mut self, msg: &ProcessingResponse) -> Result<(), Status> {
        match BodyAnswer::of(msg) {
            Some(split) => {
                let len = split.message_len();
                self.check(len)?;
                self.small.reserve(PREFIX + split.head_len());
                put_prefix(&mut self.small, len);
                split.head(&mut self.small);
                self.ready.push_back(self.small.split().freeze());
                self.ready.push_back(split.body.clone());
                split.tail(&mut self.small);
            }
            None => {
                let len = msg.encoded_len();
                self.check(len)?;
                self.small.reserve(PREFIX + len);
                put_prefix(&mut self.small, len);
                msg.encode_raw(&mut self.small);
            }
        }
        if self.small.len() >= GATHER {
            self.flush();
        }
        Ok(())
    }

    fn check(&self, len: usize) -> Result<(), Status> {
        if len > self.limit || len > u32::MAX as usize {
            return Err(Status::out_of_range(format!(
                "Error, encoded message length too large: found {len} bytes, the limit is: {} bytes",
                self.limit
            )));
        }
        Ok(())
    }

    /// What is gathered becomes a frame.
    fn flush(&mut self) {
        if !self.small.is_empty() {
            self.ready.push_back(self.small.split().freeze());
        }
    }
}

fn put_prefix(buf: &mut BytesMut, len: usize) {
    buf.put_u8(0);
    // `check` keeps `len` within u32.
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
}

impl<S> http_body::Body for ResponseBody<S>
where
    S: Stream<Item = Result<ProcessingResponse, Status>> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(frame) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(frame))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(status) = this.ended.take() {
                this.done = true;
                let mut trailers = http::HeaderMap::new();
                return Poll::Ready(Some(
                    status
                        .add_header(&mut trailers)
                        .map(|()| Frame::trailers(trailers)),
                ));
            }
            let next = match Pin::new(&mut this.source).poll_next(cx) {
                Poll::Pending if !this.small.is_empty() => {
                    this.flush();
                    continue;
                }
                other => ready!(other),
            };
            match next {
                Some(Ok(msg)) => {
                    if let Err(status) = this.push(&msg) {
                        this.flush();
                        this.ended = Some(status);
                    }
                }
                Some(Err(status)) => {
                    this.flush();
                    this.ended = Some(status);
                }
                None => {
                    this.flush();
                    this.ended = Some(Status::ok(""));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// A message carrying a body chunk of at least [`BY_REFERENCE`] bytes, in the one shape that
/// does: a request or response body answer whose common response has a body mutation.
struct BodyAnswer<'a> {
    /// The `ProcessingResponse` field (3: request body, 4: response body).
    tag: u32,
    common: &'a CommonResponse,
    body: &'a Bytes,
    /// Some(end_of_stream): the body is a `StreamedBodyResponse`'s; None: a whole-body mutation.
    streamed: Option<bool>,
    dynamic_metadata: Option<&'a envoy_types::pb::google::protobuf::Struct>,
    /// Encoded lengths, innermost first, each computed once.
    lens: Lens,
}

/// The encoded lengths of the messages around a body.
struct Lens {
    /// `StreamedBodyResponse` (streamed bodies only).
    streamed: usize,
    /// `BodyMutation`.
    mutation: usize,
    /// `CommonResponse`.
    common: usize,
    /// `BodyResponse`.
    answer: usize,
    /// The whole `ProcessingResponse`.
    message: usize,
}

impl<'a> BodyAnswer<'a> {
    fn of(msg: &'a ProcessingResponse) -> Option<Self> {
        let (tag, answer) = match msg.response.as_ref()? {
            Response::RequestBody(b) => (3, b),
            Response::ResponseBody(b) => (4, b),
            _ => return None,
        };
        let common = answer.response.as_ref()?;
        let (body, streamed) = match common.body_mutation.as_ref()?.mutation.as_ref()? {
            Mutation::StreamedResponse(s) => (&s.body, Some(s.end_of_stream)),
            Mutation::Body(b) => (b, None),
            Mutation::ClearBody(_) => return None,
        };
        if body.len() < BY_REFERENCE {
            return None;
        }
        let dynamic_metadata = msg.dynamic_metadata.as_ref();
        // A bytes field sent by reference is never empty, so proto3 always writes it.
        let body_field = nested_len(1, body.len());
        let streamed_len = streamed.map_or(0, |eos| body_field + bool_len(2, eos));
        let mutation = match streamed {
            Some(_) => nested_len(3, streamed_len),
            None => body_field,
        };
        let status = if common.status != 0 {
            encoding::int32::encoded_len(1, &common.status)
        } else {
            0
        };
        let common_len = status
            + common
                .header_mutation
                .as_ref()
                .map_or(0, |m| encoding::message::encoded_len(2, m))
            + nested_len(3, mutation)
            + common
                .trailers
                .as_ref()
                .map_or(0, |t| encoding::message::encoded_len(4, t))
            + bool_len(5, common.clear_route_cache);
        let answer_len = nested_len(1, common_len);
        let message = nested_len(tag, answer_len)
            + dynamic_metadata.map_or(0, |m| encoding::message::encoded_len(8, m));
        Some(BodyAnswer {
            tag,
            common,
            body,
            streamed,
            dynamic_metadata,
            lens: Lens {
                streamed: streamed_len,
                mutation,
                common: common_len,
                answer: answer_len,
                message,
            },
        })
    }

    /// The whole message's encoded length.
    fn message_len(&self) -> usize {
        self.lens.message
    }

    /// The message's bytes other than the body's (room enough for the part before it).
    fn head_len(&self) -> usize {
        self.lens.message - self.body.len()
    }

    /// Everything up to the body's first byte.
    fn head(&self, buf: &mut BytesMut) {
        let c = self.common;
        open(self.tag, self.lens.answer, buf);
        open(1, self.lens.common, buf);
        if c.status != 0 {
            encoding::int32::encode(1, &c.status, buf);
        }
        if let Some(m) = &c.header_mutation {
            encoding::message::encode(2, m, buf);
        }
        open(3, self.lens.mutation, buf);
        if self.streamed.is_some() {
            open(3, self.lens.streamed, buf);
        }
        open(1, self.body.len(), buf);
    }

    /// Everything after the body's last byte.
    fn tail(&self, buf: &mut BytesMut) {
        let c = self.common;
        if self.streamed == Some(true) {
            encoding::bool::encode(2, &true, buf);
        }
        if let Some(t) = &c.trailers {
            encoding::message::encode(4, t, buf);
        }
        if c.clear_route_cache {
            encoding::bool::encode(5, &true, buf);
        }
        if let Some(m) = self.dynamic_metadata {
            encoding::message::encode(8, m, buf);
        }
    }
}

/// A length-delimited field's key and length.
fn open(tag: u32, len: usize, buf: &mut BytesMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

/// A length-delimited field of `len` bytes, with its key and length.
fn nested_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// A proto3 bool: left out when false.
fn bool_len(tag: u32, value: bool) -> usize {
    if value {
        encoding::bool::encoded_len(tag, &value)
    } else {
        0
    }
}

#[cfg(test)]
mod tests;
