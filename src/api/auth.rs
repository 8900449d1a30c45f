//! The bearer-token guard of the HTTP routes that can steer traffic or reveal routing state: the
//! `/debug/*` routes of the metrics port and every write route (any method but GET, HEAD and
//! OPTIONS) of the selection service and the slot tracker, standalone or opened by `kvepp serve`.
//!
//! Invariants: without a configured token nothing is guarded (the routes bind to loopback by
//! default); with one, a guarded request passes only with `Authorization: Bearer <token>`, compared
//! in constant time, and is otherwise answered 401 with a JSON error and `WWW-Authenticate: Bearer`
//! before its body is read; each refusal is logged and counted.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use prometheus_client::metrics::counter::Counter;
use subtle::ConstantTimeEq;

use super::json::ApiError;

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read token file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("token file {0} is empty")]
    Empty(String),
    #[error("token file {0} holds characters not allowed in an HTTP header")]
    NotAscii(String),
}

/// A shared secret callers present as `Authorization: Bearer <token>`.
#[derive(Clone)]
pub struct ApiToken(Arc<[u8]>);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

impl ApiToken {
    /// The token in `path` (a mounted Secret), surrounding whitespace removed.
    pub(crate) fn from_file(path: &Path) -> Result<ApiToken, TokenError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: shown.clone(),
            source,
        })?;
        let t = text.trim();
        if t.is_empty() {
            return Err(TokenError::Empty(shown));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotAscii(shown));
        }
        Ok(ApiToken(t.as_bytes().into()))
    }

    /// Loads the token of an optional file.
    pub(crate) fn load(path: Option<&Path>) -> Result<Option<ApiToken>, TokenError> {
        path.map(ApiToken::from_file).transpose()
    }

    /// Whether `value` (an `Authorization` header) carries this token.
    pub(crate) fn admits(&self, value: Option<&HeaderValue>) -> bool {
        let Some(v) = value.map(HeaderValue::as_bytes) else {
            return false;
        };
        let Some((scheme, rest)) = v.split_first_chunk::<7>() else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case(b"bearer ") {
            return false;
        }
        let presented = rest.trim_ascii();
        // Lengths may differ; the comparison of equal lengths takes the same time for every token.
        bool::from(presented.ct_eq(&self.0))
    }
}

/// Which requests of a router the guard covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarded {
    /// Every request.
    All,
    /// Requests that change state: any method but GET, HEAD and OPTIONS.
    Writes,
}

/// The configured token (if any) and the counter of refusals: what every guarded router needs.
#[derive(Debug, Clone, Default)]
pub struct Access {
    pub token: Option<ApiToken>,
    pub refused: Counter,
}

impl Access {
    /// `router` with the guard in front of the requests `which` names; unchanged without a token.
    /// Apply it after the routes are added: unknown routes stay 404 without a token.
    pub(crate) fn guard(&self, router: Router, which: Guarded) -> Router {
        match &self.token {
            None => router,
            Some(token) => router.route_layer(axum::middleware::from_fn_with_state(
                Arc::new(Guard {
                    token: token.clone(),
                    which,
                    refused: self.refused.clone(),
                }),
                check,
            )),
        }
    }
}

#[derive(Debug)]
struct Guard {
    token: ApiToken,
    which: Guarded,
    refused: Counter,
}

async fn check(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let read_only = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if (g.which == Guarded::Writes && read_only)
        || g.token.admits(req.headers().get(header::AUTHORIZATION))
    {
        return next.run(req).await;
    }
    g.refused.inc();
    tracing::warn!(method = %req.method(), path = %req.uri().path(), "refused: missing or wrong bearer token");
    let mut resp = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "this route needs `Authorization: Bearer <token>` with the configured API token",
    )
    .into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_only_the_exact_bearer_token() {
        let dir = kvepp_test_support::TempDir::new("token");
        let f = dir.path().join("token");
        std::fs::write(&f, "s3cret-token\n").unwrap();
        let t = ApiToken::from_file(&f).unwrap();
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(t.admits(Some(&h("Bearer s3cret-token"))));
        assert!(t.admits(Some(&h("bearer s3cret-token"))));
        for bad in [
            "Bearer s3cret-toke",
            "Bearer s3cret-token2",
            "Basic s3cret-token",
            "s3cret-token",
            "Bearer",
            "",
        ] {
            assert!(!t.admits(Some(&h(bad))), "{bad:?} admitted");
        }
        assert!(!t.admits(None));
        assert!(format!("{t:?}").contains("redacted"));

        std::fs::write(&f, " \n").unwrap();
        assert!(matches!(ApiToken::from_file(&f), Err(TokenError::Empty(_))));
        assert!(matches!(
            ApiToken::from_file(&dir.path().join("missing")),
            Err(TokenError::Read { .. })
        ));
    }
}
