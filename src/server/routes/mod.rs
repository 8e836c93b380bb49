//! The route table: which of the filter's endpoints a request is, from its method and path.

pub mod chat;
pub mod models;

/// What the filter does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions`: buffer the body and pick engines.
    Chat,
    /// `GET /v1/models`: answered by the filter from the configured models.
    ListModels,
    /// Anything else goes where Envoy's own routes send it.
    PassThrough,
}

/// The route of a request; the query string does not take part.
pub fn route(method: &str, path: &str) -> Route {
    let path = path.split('?').next().unwrap_or_default();
    match (method, path) {
        ("POST", chat::CHAT_PATH) => Route::Chat,
        ("GET", models::MODELS_PATH) => Route::ListModels,
        _ => Route::PassThrough,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_method_and_path_ignoring_the_query() {
        assert_eq!(route("POST", "/v1/chat/completions"), Route::Chat);
        assert_eq!(route("POST", "/v1/chat/completions?x=1"), Route::Chat);
        assert_eq!(route("GET", "/v1/models"), Route::ListModels);
        assert_eq!(route("GET", "/v1/chat/completions"), Route::PassThrough);
        assert_eq!(route("POST", "/v1/models"), Route::PassThrough);
        assert_eq!(route("POST", "/v1/chat/completions/"), Route::PassThrough);
        assert_eq!(route("GET", "/health"), Route::PassThrough);
    }
}
