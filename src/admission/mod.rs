//! Admission: what holds or refuses a request between reading it and routing it. Flow control
//! ([`flow`]) queues requests by priority while every endpoint is saturated and hands them to the
//! routing service in order as capacity frees; rate limits ([`rate_limit`]) refuse a tenant over
//! its budget with 429. Both decide from the facts the routing service prepared
//! ([`crate::routing::RouteRequest`]); neither picks or books (the core's `Router` does).

pub mod flow;
pub mod rate_limit;

pub use flow::{FlowControl, FlowControlSettings, Grant, Ticket, Turn};
pub use rate_limit::{RateLimitSettings, RateLimiter, TenantLimit};
