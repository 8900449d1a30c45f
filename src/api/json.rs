//! What the HTTP services share: the `{"error": "..."}` body for every failure (malformed JSON,
//! oversized bodies, unknown routes, wrong methods included), the JSON body extractor with axum's
//! default limits and statuses, query filters, hashes as signed or unsigned 64-bit integers, and the
//! mapping of the core's catalog errors to statuses.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

use crate::replica::peers::PeerError;
use kvepp_core::catalog::{CatalogError, Scope};
use kvepp_core::SequenceHash;

/// An error answer: a status and `{"error": message}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, error = %self.message, "HTTP service error");
        } else {
            tracing::debug!(status = %self.status, error = %self.message, "HTTP service request refused");
        }
        (
            self.status,
            axum::Json(serde_json::json!({ "error": self.message })),
        )
            .into_response()
    }
}

impl From<PeerError> for ApiError {
    fn from(e: PeerError) -> Self {
        let status = match &e {
            PeerError::Invalid(_) => StatusCode::BAD_REQUEST,
            PeerError::TooMany => StatusCode::TOO_MANY_REQUESTS,
            PeerError::Unknown(_) => StatusCode::NOT_FOUND,
        };
        ApiError::new(status, e.to_string())
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> Self {
        use CatalogError as E;
        let status = match &e {
            E::ZeroBlockSize
            | E::ZeroDpSize
            | E::DpRangeOverflow { .. }
            | E::TooManyRanks { .. }
            | E::EffectiveAboveInput { .. } => StatusCode::BAD_REQUEST,
            E::BlockSizeMismatch { .. } | E::DuplicateReservation(_) | E::Pooled => {
                StatusCode::CONFLICT
            }
            E::UnknownScope { .. }
            | E::UnknownWorker(_)
            | E::UnknownRank { .. }
            | E::UnknownReservation(_) => StatusCode::NOT_FOUND,
            E::TooManyWorkers(_) | E::TooManyReservations(_) => StatusCode::TOO_MANY_REQUESTS,
            E::Refused(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, e.to_string())
    }
}

/// A JSON body with axum's default handling (content type, 2 MiB limit, syntax and data errors
/// with axum's statuses), its failures answered as `{"error": ...}`.
#[derive(Debug, Clone)]
pub struct Body<T>(pub T);

impl<S, T> FromRequest<S> for Body<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Body(v)),
            Err(r) => Err(rejection(r)),
        }
    }
}

fn rejection(r: JsonRejection) -> ApiError {
    let status = r.status();
    let message = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "request body is too large".to_string(),
        _ => r.body_text(),
    };
    ApiError::new(status, message)
}

/// `{"status": "ok"}`, with a status.
pub(crate) fn ok(status: StatusCode) -> Response {
    (status, axum::Json(serde_json::json!({"status": "ok"}))).into_response()
}

pub(crate) async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route for {method} {}", uri.path()),
    )
}

pub(crate) async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

/// `model_name` and `tenant_id` filters of a query string (each optional).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ScopeFilter {
    pub model: Option<String>,
    pub tenant: Option<String>,
}

impl ScopeFilter {
    pub(crate) fn parse(query: Option<&str>) -> Self {
        let mut f = ScopeFilter::default();
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*k {
                "model_name" => f.model = Some(v.into_owned()),
                "tenant_id" => f.tenant = Some(v.into_owned()),
                _ => {}
            }
        }
        f
    }

    pub(crate) fn admits(&self, scope: &Scope) -> bool {
        self.model.as_ref().is_none_or(|m| *m == scope.model)
            && self.tenant.as_ref().is_none_or(|t| *t == scope.tenant)
    }
}

pub(crate) fn default_tenant() -> String {
    "default".to_string()
}

pub(crate) fn default_model() -> String {
    "default".to_string()
}

/// A 64-bit hash sent as a JSON integer, signed or unsigned: a negative value is the same 64 bits
/// read as two's complement (Dynamo's clients send `i64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hash64(pub u64);

impl<'de> Deserialize<'de> for Hash64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Hash64;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a 64-bit integer")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Hash64, E> {
                Ok(Hash64(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Hash64, E> {
                Ok(Hash64(v as u64))
            }
        }
        d.deserialize_i64(V)
    }
}

pub(crate) fn sequence_hashes(v: &[Hash64]) -> Vec<SequenceHash> {
    v.iter().map(|h| SequenceHash(h.0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_read_signed_and_unsigned_bit_for_bit() {
        let v: Vec<Hash64> = serde_json::from_str("[101, -22, 18446744073709551615]").unwrap();
        assert_eq!(v, [Hash64(101), Hash64(-22i64 as u64), Hash64(u64::MAX)]);
        assert!(serde_json::from_str::<Vec<Hash64>>("[1.5]").is_err());
        assert!(serde_json::from_str::<Vec<Hash64>>("[\"1\"]").is_err());
    }

    #[test]
    fn filters_decode_percent_escapes() {
        let f = ScopeFilter::parse(Some("model_name=meta%2Fllama&tenant_id=t1&x=y"));
        assert_eq!(f.model.as_deref(), Some("meta/llama"));
        assert!(f.admits(&Scope {
            model: "meta/llama".into(),
            tenant: "t1".into()
        }));
        assert!(!f.admits(&Scope {
            model: "meta/llama".into(),
            tenant: "t2".into()
        }));
        assert!(ScopeFilter::parse(None).admits(&Scope {
            model: "a".into(),
            tenant: "b".into()
        }));
    }
}
