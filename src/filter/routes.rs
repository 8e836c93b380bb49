//! The route table: which of the filter's endpoints a request is, from its method and path.

use super::generation::Endpoint;
use super::models;
use super::{ErrorKind, RouteError};

/// What the filter does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST` to a generation endpoint (chat, completions, `/generate`): buffer the body and pick
    /// engines.
    Generation(Endpoint),
    /// `GET /v1/models`: answered by the filter from the configured models.
    ListModels,
    /// `GET /v1/models/{id}`: one configured model, or OpenAI's 404.
    RetrieveModel,
    /// A path of the filter's with another method: 405, and `Allow` names the one that works.
    MethodNotAllowed { allow: &'static str },
    /// Anything else goes where Envoy's own routes send it.
    PassThrough,
}

/// The route of a request; the query string does not take part.
pub fn route(method: &str, path: &str) -> Route {
    let path = path.split('?').next().unwrap_or_default();
    if let Some(endpoint) = Endpoint::from_path(path) {
        return match method {
            "POST" => Route::Generation(endpoint),
            _ => Route::MethodNotAllowed { allow: "POST" },
        };
    }
    match (method, path) {
        ("GET", models::MODELS_PATH) => Route::ListModels,
        ("GET", p) if p.len() > models::MODEL_PATH_PREFIX.len() && p.starts_with(models::MODEL_PATH_PREFIX) => {
            Route::RetrieveModel
        }
        (_, models::MODELS_PATH) => Route::MethodNotAllowed { allow: "GET" },
        _ => Route::PassThrough,
    }
}

/// The error a [`Route::MethodNotAllowed`] answers with.
pub fn method_not_allowed(method: &str, path: &str, allow: &str) -> RouteError {
    let path = path.split('?').next().unwrap_or_default();
    RouteError::new(ErrorKind::MethodNotAllowed, format!("{method} is not allowed on {path}; use {allow}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn routes_by_method_and_path_ignoring_the_query() {
        assert_eq!(route("POST", "/v1/chat/completions"), Route::Generation(Endpoint::Chat));
        assert_eq!(route("POST", "/v1/chat/completions?x=1"), Route::Generation(Endpoint::Chat));
        assert_eq!(route("POST", "/v1/completions"), Route::Generation(Endpoint::Completions));
        assert_eq!(route("POST", "/generate"), Route::Generation(Endpoint::Generate));
        assert_eq!(route("GET", "/generate"), Route::MethodNotAllowed { allow: "POST" });
        assert_eq!(route("GET", "/v1/models"), Route::ListModels);
        assert_eq!(route("GET", "/v1/chat/completions"), Route::MethodNotAllowed { allow: "POST" });
        assert_eq!(route("DELETE", "/v1/chat/completions?a"), Route::MethodNotAllowed { allow: "POST" });
        assert_eq!(route("PUT", "/v1/chat/completions"), Route::MethodNotAllowed { allow: "POST" });
        assert_eq!(route("POST", "/v1/models"), Route::MethodNotAllowed { allow: "GET" });
        let e = method_not_allowed("GET", "/v1/chat/completions?x", "POST");
        assert_eq!((e.status(), e.kind.type_name()), (405, "method_not_allowed"));
        assert_eq!(e.message, "GET is not allowed on /v1/chat/completions; use POST");
        assert_eq!(route("GET", "/v1/models/llama?x=1"), Route::RetrieveModel);
        assert_eq!(route("GET", "/v1/models/"), Route::PassThrough);
        assert_eq!(route("POST", "/v1/chat/completions/"), Route::PassThrough);
        assert_eq!(route("GET", "/health"), Route::PassThrough);
    }
}
