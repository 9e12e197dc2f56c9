//! The HTTP/1 plumbing the fakes and the proxy share: one request per connection (every answer
//! says `Connection: close`), read whole by its Content-Length.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads one message: (head with its blank line, body).
pub async fn read_message(s: &mut TcpStream) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf.split_off(head_end);
    Ok((buf, body))
}

pub fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// Replaces any Connection header with `Connection: close`.
pub fn close_connection(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::new();
    for line in text.trim_end_matches("\r\n").split("\r\n") {
        if line.to_ascii_lowercase().starts_with("connection:") {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

/// A header's value (case-insensitive name).
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// What a fake HTTP server answers: (status, extra headers, body) for (method, path, head).
pub type Handler =
    Arc<dyn Fn(&str, &str, &str) -> (u16, Vec<(String, String)>, String) + Send + Sync>;

/// A tiny HTTP server on the current runtime (fake IMDS, fake ECS agent).
pub async fn serve_http(handler: Handler) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let handler = handler.clone();
            tokio::spawn(async move {
                let Ok((head, _)) = read_message(&mut sock).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&head).to_string();
                let mut first = head.split_whitespace();
                let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
                let (status, headers, body) = handler(method, path, &head);
                let mut resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                    body.len()
                );
                for (k, v) in headers {
                    resp.push_str(&format!("{k}: {v}\r\n"));
                }
                resp.push_str("\r\n");
                resp.push_str(&body);
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    addr
}

/// A blocking HTTP/1.0 request; None when nothing answers.
pub fn http_sync(addr: SocketAddr, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    http_sync_with(
        addr,
        method,
        path,
        "Content-Type: application/json\r\n",
        body,
    )
}

/// The same with these header lines (each ending in `\r\n`).
pub fn http_sync_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// `GET /metrics` of a gpu-medic metrics endpoint at `addr`: the whole answer, head included
/// ("" while nothing listens there).
pub fn scrape(addr: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .is_err()
    {
        return String::new();
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The value of the first series in `body` whose line starts with `prefix` (a metric name and
/// the start of its labels).
pub fn series(body: &str, prefix: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
