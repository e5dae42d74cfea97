//! The remote tier against real sockets: a fake HTTP store in the Bazel
//! layout, and every fault the issue names (closed port, junk, garbage, slow
//! past the timeout, connection dropped mid-body), for HTTP and Redis. Each
//! must end as a miss, quickly, with nothing stored locally.

mod common;

use std::time::{Duration, Instant};

use common::fake_server::{closed_port, FakeServer, Mode};
use ipuq_cache::{to_hex, Cache, CacheOptions, Remote, RemoteOptions};

fn local() -> (tempfile::TempDir, Cache) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = Cache::open(dir.path(), CacheOptions::default()).expect("cache");
    (dir, cache)
}

fn options(url: String) -> RemoteOptions {
    RemoteOptions { io_timeout: Duration::from_millis(300), connect_timeout: Duration::from_millis(300), upload_wait: Duration::from_secs(5), ..RemoteOptions::new(url) }
}

/// Uploads one entry through a fresh remote and waits for it.
fn upload(url: String, key: u8, payload: &[u8]) {
    let mut remote = Remote::open(&options(url)).expect("remote");
    remote.upload("plan", &[key; 32], 3, payload);
    remote.finish(None);
    assert_eq!(remote.counters().errors, 0);
}

#[test]
fn http_store_round_trip_uses_the_bazel_layout() {
    let server = FakeServer::start(Mode::Store);
    upload(server.url("team/ipuq"), 1, b"stage output");
    let digest = to_hex(&ipuq_cache::digest_of(b"stage output"));
    let names: Vec<String> = server.entries.lock().unwrap().keys().cloned().collect();
    assert!(names.contains(&format!("/team/ipuq/cas/{digest}")), "{names:?}");
    assert!(names.contains(&format!("/team/ipuq/ac/{}", to_hex(&[1; 32]))), "{names:?}");
    assert_eq!(server.entries.lock().unwrap()[&format!("/team/ipuq/cas/{digest}")], b"stage output");

    let (_dir, cache) = local();
    let remote = Remote::open(&options(server.url("team/ipuq"))).expect("remote");
    assert_eq!(remote.fetch(&cache, "plan", &[1; 32], 3).expect("hit").as_slice(), b"stage output");
    assert!(remote.fetch(&cache, "plan", &[2; 32], 3).is_none());
    let counters = remote.counters();
    assert_eq!((counters.hits, counters.misses, counters.errors), (1, 1, 0));
    assert_eq!(cache.get("plan", &[1; 32], 3).expect("copied").as_slice(), b"stage output");
}

/// Fetches ten keys; the remote must fail them all as misses, quickly, and disable itself.
fn assert_fails_fast(url: String, limit: Duration) {
    let (_dir, cache) = local();
    let remote = Remote::open(&options(url.clone())).expect("remote");
    let start = Instant::now();
    for key in 0..10u8 {
        assert!(remote.fetch(&cache, "plan", &[key; 32], 3).is_none(), "{url}");
    }
    assert!(start.elapsed() < limit, "{url}: {:?}", start.elapsed());
    assert!(remote.is_disabled(), "{url}");
    assert!(remote.counters().errors >= 1);
    assert!(cache.get("plan", &[0; 32], 3).is_none());
}

#[test]
fn closed_ports_fail_fast_for_http_and_redis() {
    assert_fails_fast(format!("http://127.0.0.1:{}/c", closed_port()), Duration::from_secs(2));
    assert_fails_fast(format!("redis://127.0.0.1:{}/0", closed_port()), Duration::from_secs(2));
}

#[test]
fn junk_and_garbage_answers_are_misses() {
    let junk = FakeServer::start(Mode::Junk);
    assert_fails_fast(junk.url("c"), Duration::from_secs(2));
    let garbage = FakeServer::start(Mode::Garbage);
    assert_fails_fast(garbage.url("c"), Duration::from_secs(2));
    assert_fails_fast(format!("redis://127.0.0.1:{}/0", garbage.port), Duration::from_secs(2));
}

#[test]
fn a_slow_server_times_out_and_is_disabled() {
    let slow = FakeServer::start(Mode::Slow(Duration::from_secs(3)));
    // Three requests at 300 ms each (Redis: connect, then a handshake also bounded by the
    // connect timeout), then disabled.
    assert_fails_fast(slow.url("c"), Duration::from_millis(2500));
    assert_fails_fast(format!("redis://127.0.0.1:{}/0", slow.port), Duration::from_secs(3));
}

#[test]
fn a_body_dropped_midway_is_a_miss_and_stores_nothing() {
    let server = FakeServer::start(Mode::Store);
    let payload = vec![7u8; 100_000];
    upload(server.url("c"), 1, &payload);
    server.set_mode(Mode::DropMidBody);
    let (_dir, cache) = local();
    let remote = Remote::open(&options(server.url("c"))).expect("remote");
    assert!(remote.fetch(&cache, "plan", &[1; 32], 3).is_none());
    assert_eq!(remote.counters().errors, 1);
    assert!(cache.get("plan", &[1; 32], 3).is_none());
}

#[test]
fn uploads_to_a_junk_server_never_block_past_the_wait() {
    let slow = FakeServer::start(Mode::Slow(Duration::from_secs(3)));
    let mut remote = Remote::open(&RemoteOptions { upload_wait: Duration::from_millis(200), ..options(slow.url("c")) }).expect("remote");
    let start = Instant::now();
    for key in 0..20u8 {
        remote.upload("plan", &[key; 32], 3, b"x");
    }
    assert!(start.elapsed() < Duration::from_millis(100), "enqueueing blocked");
    remote.finish(None);
    assert!(start.elapsed() < Duration::from_secs(1), "finish waited {:?}", start.elapsed());
    assert_eq!(remote.counters().uploads, 0);
}
