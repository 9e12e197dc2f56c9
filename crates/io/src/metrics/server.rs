//! The metrics endpoint: hyper's HTTP/1 server on the daemon's tokio runtime, bounded so that
//! no client can take the supervisor down (issue 26):
//!
//! - at most `[metrics] max_connections` connections at once; one beyond is closed at once,
//!   so the endpoint's descriptors are bounded and the supervisor always has some left;
//! - a request head must arrive within [`HEADER_TIMEOUT`] (a client that trickles its
//!   headers byte by byte is cut off) and be at most [`MAX_HEAD`] bytes (hyper answers 431);
//!   a connection lives at most [`CONNECTION_LIFETIME`], and answers one request (no
//!   keep-alive: a scrape every few seconds on loopback costs nothing to reconnect);
//! - only `GET /metrics` is answered (another path: 404; another method: 405);
//! - accept errors (EMFILE and the like) are logged at most once per
//!   [`WARN_INTERVAL`] with how many there were, and the loop backs off on each;
//! - an address it cannot bind (another exporter holds the port) is a warning and a
//!   self-fault (component [`COMPONENT`]), never an exit: the endpoint tries again every
//!   `[metrics] retry` and reports the self-fault recovered once it listens.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Metrics;
use crate::config::MetricsConfig;
use crate::model::{Observation, Signal};

/// The self-fault component of an endpoint that cannot listen.
pub const COMPONENT: &str = "metrics";

/// How long a client has to send a whole request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest a connection is kept, whatever it does (a client that never reads its answer).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// The largest request head read (hyper's smallest buffer; a scrape's head is a few hundred
/// bytes). Bodies are never read.
pub const MAX_HEAD: usize = 8 * 1024;

/// At most one warning per this long for accept errors and refused connections.
pub const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// How long a connection past the cap waits for a slot before it is closed.
const SLOT_WAIT: Duration = Duration::from_millis(10);

/// What bounds the endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub lifetime: Duration,
}

impl Limits {
    pub fn from_config(cfg: &MetricsConfig) -> Self {
        Limits {
            max_connections: cfg.max_connections.max(1),
            header_timeout: HEADER_TIMEOUT,
            lifetime: CONNECTION_LIFETIME,
        }
    }
}

/// The endpoint as a source of gpu-medic's own observations: it binds `[metrics] listen`
/// (again every `[metrics] retry` while it cannot), serves, and says whether it listens.
pub struct Endpoint {
    listen: SocketAddr,
    retry: Duration,
    limits: Limits,
    metrics: Arc<Metrics>,
}

impl Endpoint {
    pub fn new(cfg: &MetricsConfig, metrics: Arc<Metrics>) -> Self {
        Endpoint {
            listen: cfg.listen,
            retry: cfg.retry,
            limits: Limits::from_config(cfg),
            metrics,
        }
    }

    /// Binds, then serves until `shutdown`; a bind that fails is said once (a warning and
    /// the self-fault) and tried again every `retry`.
    pub async fn run(self, tx: mpsc::Sender<Observation>, shutdown: CancellationToken) {
        let mut failing = false;
        loop {
            match tokio::net::TcpListener::bind(self.listen).await {
                Ok(listener) => {
                    let detail = format!("metrics endpoint listening on {}", self.listen);
                    if failing {
                        tracing::info!("{detail} (the address is free again)");
                    }
                    let _ = tx
                        .send(
                            Observation::new(Signal::SelfRecovered {
                                component: COMPONENT.into(),
                            })
                            .with_detail(detail)
                            .from_source(COMPONENT),
                        )
                        .await;
                    serve(listener, self.metrics, self.limits, shutdown).await;
                    return;
                }
                Err(e) => {
                    if failing {
                        // Said once; each retry only at debug (tests count them).
                        tracing::debug!(listen = %self.listen, "metrics: still cannot listen: {e}");
                    }
                    if !std::mem::replace(&mut failing, true) {
                        let detail = format!(
                            "metrics: cannot listen on {}: {e}; gpu-medic goes on without its \
                             metrics endpoint and tries again every {} (is another exporter \
                             on that port? set [metrics] listen)",
                            self.listen,
                            humantime::format_duration(self.retry)
                        );
                        tracing::warn!("{detail}");
                        let _ = tx
                            .send(
                                Observation::new(Signal::SelfFault {
                                    component: COMPONENT.into(),
                                })
                                .with_detail(detail)
                                .from_source(COMPONENT),
                            )
                            .await;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.retry) => {}
            }
        }
    }
}

/// For `check`: why `[metrics] listen` cannot be bound by `run` (another program holds the
/// port), or `None` (metrics off, the address free, or a gpu-medic already serving there).
pub fn port_taken(cfg: &MetricsConfig) -> Option<String> {
    if !cfg.enabled {
        return None;
    }
    let e = match std::net::TcpListener::bind(cfg.listen) {
        Ok(_) => return None,
        Err(e) => e,
    };
    if e.kind() == std::io::ErrorKind::AddrInUse && serves_gpu_medic(cfg.listen) {
        return None;
    }
    Some(format!(
        "[metrics] listen: cannot listen on {}: {e}; `run` would go on without its metrics \
         endpoint (a self-fault, tried again every {}); is another exporter on that port?",
        cfg.listen,
        humantime::format_duration(cfg.retry)
    ))
}

/// Whether what listens at `addr` answers a scrape as gpu-medic does (within a second).
fn serves_gpu_medic(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let wait = Duration::from_secs(1);
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, wait) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(wait));
    let _ = s.set_write_timeout(Some(wait));
    if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 4096];
    let mut got = 0;
    while got < head.len() {
        match s.read(&mut head[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    String::from_utf8_lossy(&head[..got]).contains("gpu_medic_")
}

/// Counts a recurring problem and says it at most once per [`WARN_INTERVAL`], with how many
/// times it happened since it was last said.
struct Throttled {
    what: &'static str,
    last: Option<Instant>,
    count: u64,
}

impl Throttled {
    fn new(what: &'static str) -> Self {
        Throttled {
            what,
            last: None,
            count: 0,
        }
    }

    fn note(&mut self, detail: &dyn std::fmt::Display) {
        self.count = self.count.saturating_add(1);
        let now = Instant::now();
        if self
            .last
            .is_none_or(|t| now.duration_since(t) >= WARN_INTERVAL)
        {
            tracing::warn!(
                "{}: {detail} ({} time(s) since the last warning; at most one warning per {}s)",
                self.what,
                self.count,
                WARN_INTERVAL.as_secs()
            );
            self.last = Some(now);
            self.count = 0;
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown`. Loopback addresses only: the
/// config check refuses others. Every connection ends with it.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    limits: Limits,
    shutdown: CancellationToken,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, max_connections = limits.max_connections, "metrics endpoint listening");
    }
    let mut conns = JoinSet::new();
    let mut accept_errors = Throttled::new("metrics: accept failed");
    let mut refused = Throttled::new("metrics: connection closed at once");
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        if accepted.is_ok() && conns.len() >= limits.max_connections {
            // A connection that just answered may not have ended yet (its client saw the
            // close first): a moment for its slot before refusing.
            let _ = tokio::time::timeout(SLOT_WAIT, conns.join_next()).await;
            while conns.try_join_next().is_some() {}
        }
        match accepted {
            Ok((sock, _)) if conns.len() >= limits.max_connections => {
                drop(sock);
                refused.note(&format_args!(
                    "{} connections already open (the cap)",
                    limits.max_connections
                ));
            }
            Ok((sock, _)) => {
                conns.spawn(connection(sock, metrics.clone(), limits));
            }
            Err(e) => {
                accept_errors.note(&e);
                // Out of descriptors: give the connections time to end instead of spinning.
                let pause = match e.raw_os_error() {
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => 100,
                    _ => 10,
                };
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
                }
            }
        }
    }
    conns.shutdown().await;
}

/// One connection: one request answered, within the head timeout and the lifetime.
async fn connection(sock: tokio::net::TcpStream, metrics: Arc<Metrics>, limits: Limits) {
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let metrics = metrics.clone();
        async move { Ok::<_, Infallible>(answer(&req, &metrics)) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEAD)
        .keep_alive(false)
        .serve_connection(TokioIo::new(sock), service);
    let _ = tokio::time::timeout(limits.lifetime, conn).await;
}

/// The answer to one request: the exposition for `GET /metrics`, else 404 or 405.
fn answer(req: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (status, body, ctype) = if req.uri().path() != "/metrics" {
        (
            StatusCode::NOT_FOUND,
            "try /metrics\n".to_string(),
            "text/plain",
        )
    } else if req.method() != Method::GET {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET\n".to_string(),
            "text/plain",
        )
    } else {
        (
            StatusCode::OK,
            metrics.render(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    if status == StatusCode::METHOD_NOT_ALLOWED {
        h.insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET"),
        );
    }
    r
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    fn limits(max_connections: usize, header_timeout: Duration) -> Limits {
        Limits {
            max_connections,
            header_timeout,
            lifetime: CONNECTION_LIFETIME,
        }
    }

    async fn start(l: Limits) -> (SocketAddr, CancellationToken) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, Arc::new(Metrics::new()), l, stop.clone()));
        (addr, stop)
    }

    async fn request(addr: SocketAddr, parts: &[&str]) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        for part in parts {
            s.write_all(part.as_bytes()).await.unwrap();
            s.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    /// A scrape whose request arrives in several writes gets the whole answer, and the
    /// connection closes after it; other paths are 404, other methods 405.
    #[tokio::test]
    async fn only_get_metrics_is_answered_however_the_request_is_split() {
        let (addr, stop) = start(limits(8, HEADER_TIMEOUT)).await;
        let out = request(
            addr,
            &["GET /metr", "ics HTTP/1.1\r\n", "Host: x\r\n", "\r\n"],
        )
        .await;
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("gpu_medic_"), "{out}");
        let out = request(addr, &["GET / HTTP/1.1\r\nHost: x\r\n\r\n"]).await;
        assert!(out.starts_with("HTTP/1.1 404"), "{out}");
        let out = request(
            addr,
            &["POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"],
        )
        .await;
        assert!(out.starts_with("HTTP/1.1 405"), "{out}");
        assert!(out.to_ascii_lowercase().contains("allow: get"), "{out}");
        let huge = format!(
            "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
            "a".repeat(MAX_HEAD * 2)
        );
        let out = request(addr, &[&huge]).await;
        assert!(
            !out.starts_with("HTTP/1.1 200"),
            "a head over the cap: {out}"
        );
        stop.cancel();
    }

    /// A client that trickles its head one byte at a time is cut off at the head timeout,
    /// long before it is done.
    #[tokio::test]
    async fn a_slow_client_is_cut_off() {
        let (addr, stop) = start(limits(8, Duration::from_millis(300))).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "GET /metrics HTTP/1.1\r\nX-Slow: {}\r\n\r\n",
            "a".repeat(400)
        );
        let mut cut = false;
        for b in head.bytes() {
            if s.write_all(&[b]).await.is_err() {
                cut = true;
                break;
            }
            let mut buf = [0u8; 256];
            match tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => {
                    cut = true;
                    break;
                }
                Ok(Ok(_)) => {
                    // hyper answers 408 before closing: read on to the close.
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest).await;
                    cut = true;
                    break;
                }
                Err(_) => {}
            }
        }
        assert!(
            cut,
            "the whole head was trickled in without the server closing"
        );
        stop.cancel();
    }

    /// Past the cap a connection is closed at once; the ones held stay, and once they go a
    /// scrape is answered again.
    #[tokio::test]
    async fn connections_past_the_cap_are_closed_at_once() {
        let (addr, stop) = start(limits(4, Duration::from_secs(60))).await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        // Let the server accept them before the extra ones arrive.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..6 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let mut buf = [0u8; 16];
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
                .await
                .expect("a connection past the cap is closed, not held");
            assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
        }
        drop(held);
        let mut out = String::new();
        for _ in 0..50 {
            out = request(addr, &["GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"]).await;
            if out.starts_with("HTTP/1.1 200") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        stop.cancel();
    }

    /// A taken port is one self-fault, tried again until it is free, then recovered.
    #[tokio::test]
    async fn a_taken_port_is_a_self_fault_until_it_frees() {
        let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let cfg = MetricsConfig {
            enabled: true,
            listen: blocker.local_addr().unwrap(),
            retry: Duration::from_secs(1),
            ..MetricsConfig::default()
        };
        let (tx, mut rx) = mpsc::channel(8);
        let stop = CancellationToken::new();
        let task =
            tokio::spawn(Endpoint::new(&cfg, Arc::new(Metrics::new())).run(tx, stop.clone()));
        let first = rx.recv().await.unwrap();
        assert!(
            matches!(&first.signal, Signal::SelfFault { component } if component == COMPONENT),
            "{first:?}"
        );
        // Still taken after a retry: nothing more is said.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(rx.try_recv().is_err());
        drop(blocker);
        let next = rx.recv().await.unwrap();
        assert!(
            matches!(&next.signal, Signal::SelfRecovered { component } if component == COMPONENT),
            "{next:?}"
        );
        let out = request(cfg.listen, &["GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"]).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        stop.cancel();
        task.await.unwrap();
    }
}
