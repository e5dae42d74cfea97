//! The HTTP backend: the Bazel remote-cache layout over plain GET, HEAD and
//! PUT, as served by nginx with WebDAV (`dav_methods PUT;
//! create_full_put_path on;`) or any object store behind HTTP.
//!
//! `http://user:pass@host:port/prefix` sends HTTP basic authentication; the
//! credentials are cut out of the URL before it reaches the HTTP client, so
//! no error or log line can carry them. A 404 is a miss; any other status
//! that is not 2xx is an error. Bodies are read up to [`MAX_BODY`] bytes; a
//! short or dropped body is a transport error, and a wrong one fails the
//! blake3 checks in `mod.rs`.

use ureq::Agent;

use super::{Area, Backend, RemoteError, RemoteOptions};

/// Largest body accepted from the server.
pub(crate) const MAX_BODY: u64 = 4 << 30;

pub(crate) struct HttpBackend {
    agent: Agent,
    /// `http://host:port/prefix`, without credentials or a trailing slash.
    base: String,
    authorization: Option<String>,
}

impl HttpBackend {
    pub(crate) fn new(url: &str, options: &RemoteOptions) -> Result<HttpBackend, RemoteError> {
        let (base, credentials) = split_credentials(url);
        let host = base.trim_start_matches("http://").split('/').next().unwrap_or("");
        if host.is_empty() || base.contains(['?', '#', ' ']) {
            return Err(RemoteError::Url {
                url: super::redact(url),
                reason: "expected http://HOST:PORT/PREFIX (no query or fragment)".into(),
            });
        }
        let io = Some(options.io_timeout);
        let agent: Agent = Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(options.connect_timeout))
            .timeout_send_request(io)
            .timeout_send_body(io)
            .timeout_recv_response(io)
            .timeout_recv_body(io)
            .user_agent(concat!("ipuq/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(HttpBackend {
            agent,
            base: base.trim_end_matches('/').to_owned(),
            authorization: credentials.map(|c| format!("Basic {}", base64(c.as_bytes()))),
        })
    }

    fn url(&self, area: Area, hex: &str) -> String {
        format!("{}/{}/{hex}", self.base, area.dir())
    }
}

fn transport(error: ureq::Error) -> RemoteError {
    RemoteError::Transport(error.to_string())
}

impl Backend for HttpBackend {
    fn get(&self, area: Area, hex: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        let mut request = self.agent.get(self.url(area, hex));
        if let Some(authorization) = &self.authorization {
            request = request.header("Authorization", authorization);
        }
        let mut response = request.call().map_err(transport)?;
        match response.status().as_u16() {
            200 => response.body_mut().with_config().limit(MAX_BODY).read_to_vec().map(Some).map_err(transport),
            404 => Ok(None),
            status => Err(RemoteError::Status(status)),
        }
    }

    fn contains(&self, area: Area, hex: &str) -> Result<bool, RemoteError> {
        let mut request = self.agent.head(self.url(area, hex));
        if let Some(authorization) = &self.authorization {
            request = request.header("Authorization", authorization);
        }
        let response = request.call().map_err(transport)?;
        match response.status().as_u16() {
            200 => Ok(true),
            404 => Ok(false),
            status => Err(RemoteError::Status(status)),
        }
    }

    fn put(&self, area: Area, hex: &str, bytes: &[u8]) -> Result<(), RemoteError> {
        let mut request = self.agent.put(self.url(area, hex)).header("Content-Type", "application/octet-stream");
        if let Some(authorization) = &self.authorization {
            request = request.header("Authorization", authorization);
        }
        let response = request.send(bytes).map_err(transport)?;
        match response.status().as_u16() {
            200..=299 => Ok(()),
            status => Err(RemoteError::Status(status)),
        }
    }
}

/// `http://user:pass@host/p` → (`http://host/p`, `Some("user:pass")`).
fn split_credentials(url: &str) -> (String, Option<String>) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_owned(), None);
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => (format!("{scheme}://{}", &rest[at + 1..]), Some(rest[..at].to_owned())),
        None => (url.to_owned(), None),
    }
}

/// Standard base64 with padding (RFC 4648), for the basic-auth header.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_cut_out_and_encoded() {
        let (base, credentials) = split_credentials("http://ci:s3cret@cache.local:8080/ipuq");
        assert_eq!(base, "http://cache.local:8080/ipuq");
        assert_eq!(credentials.as_deref(), Some("ci:s3cret"));
        assert_eq!(split_credentials("http://h:1/a@b").1, None);
        assert_eq!(base64(b"Aladdin:open sesame"), "QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b""), "");
    }

    #[test]
    fn urls_follow_the_bazel_layout() {
        let backend = HttpBackend::new("http://127.0.0.1:9/cache/", &RemoteOptions::new("")).expect("valid");
        assert_eq!(backend.url(Area::Ac, "ab12"), "http://127.0.0.1:9/cache/ac/ab12");
        assert_eq!(backend.url(Area::Cas, "cd34"), "http://127.0.0.1:9/cache/cas/cd34");
        assert!(HttpBackend::new("http:///x", &RemoteOptions::new("")).is_err());
    }
}
