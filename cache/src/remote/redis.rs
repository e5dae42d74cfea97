//! The Redis backend: `ac/<key>` and `cas/<digest>` as Redis keys in the
//! database the URL names (`redis://[user:pass@]host:port/db`), through the
//! `redis` crate's synchronous API.
//!
//! Connections are kept in a small pool shared by the build's threads and the
//! upload thread; a connection that saw an error is dropped, not returned.
//! Each is opened with the connect timeout and given the I/O timeout for
//! reads and writes. Credentials stay inside the client: errors are shown
//! through the redacted URL, and the `redis` crate's messages do not carry
//! the password.

use std::sync::Mutex;
use std::time::Duration;

use ::redis::{Client, Connection, RedisError};

use super::{Area, Backend, RemoteError, RemoteOptions};

/// Idle connections kept for reuse.
const POOL: usize = 8;

pub(crate) struct RedisBackend {
    client: Client,
    idle: Mutex<Vec<Connection>>,
    connect_timeout: Duration,
    io_timeout: Duration,
}

fn transport(error: RedisError) -> RemoteError {
    RemoteError::Transport(format!("redis: {error}"))
}

impl RedisBackend {
    pub(crate) fn new(url: &str, options: &RemoteOptions) -> Result<RedisBackend, RemoteError> {
        let client = Client::open(url).map_err(|error| RemoteError::Url {
            url: super::redact(url),
            reason: format!("expected redis://HOST:PORT/DB ({})", error.category()),
        })?;
        Ok(RedisBackend { client, idle: Mutex::new(Vec::new()), connect_timeout: options.connect_timeout, io_timeout: options.io_timeout })
    }

    fn connection(&self) -> Result<Connection, RemoteError> {
        if let Some(connection) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(connection);
        }
        let connection = self.client.get_connection_with_timeout(self.connect_timeout).map_err(transport)?;
        connection.set_read_timeout(Some(self.io_timeout)).map_err(transport)?;
        connection.set_write_timeout(Some(self.io_timeout)).map_err(transport)?;
        Ok(connection)
    }

    /// Runs one command on a pooled connection, returning the connection to
    /// the pool only when the command succeeded.
    fn with<T>(&self, command: impl FnOnce(&mut Connection) -> Result<T, RedisError>) -> Result<T, RemoteError> {
        let mut connection = self.connection()?;
        let result = command(&mut connection).map_err(transport)?;
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < POOL {
            idle.push(connection);
        }
        Ok(result)
    }
}

fn name(area: Area, hex: &str) -> String {
    format!("{}/{hex}", area.dir())
}

impl Backend for RedisBackend {
    fn get(&self, area: Area, hex: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        self.with(|c| ::redis::cmd("GET").arg(name(area, hex)).query::<Option<Vec<u8>>>(c))
    }

    fn contains(&self, area: Area, hex: &str) -> Result<bool, RemoteError> {
        self.with(|c| ::redis::cmd("EXISTS").arg(name(area, hex)).query::<bool>(c))
    }

    fn put(&self, area: Area, hex: &str, bytes: &[u8]) -> Result<(), RemoteError> {
        self.with(|c| ::redis::cmd("SET").arg(name(area, hex)).arg(bytes).query::<()>(c))
    }
}
