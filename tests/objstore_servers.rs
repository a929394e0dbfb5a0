//! The object-store test servers are real and the harness drives them with the official
//! clients: each launcher round-trips a model directory (boto3 against moto, google-cloud-storage
//! against gcp-storage-emulator, azure-storage-blob against azurite), and the counting proxy
//! forwards, counts and breaks requests as told, in both modes.

mod common;
mod objstore_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use objstore_common::proxy::{Fault, FaultKind, Proxy};
use objstore_common::{run_client, Kind, ObjectServer};

fn round_trip(kind: Kind) {
    let server = ObjectServer::start(kind);
    let env = common::TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 11, 300_000);
    server.create_bucket("models");
    server.upload_dir("models", "org/model/", &src);

    let listed: Vec<(String, u64)> = server
        .list("models", "org/model/")
        .into_iter()
        .map(|o| (o.key, o.size))
        .collect();
    let want: Vec<(String, u64)> = common::tree(&src)
        .into_iter()
        .filter(|(_, v)| !v.0)
        .map(|(k, v)| (format!("org/model/{k}"), v.1))
        .collect();
    assert_eq!(listed, want, "{kind:?} listing");

    let back = env.dir("back");
    server.download_dir("models", "org/model/", &back);
    assert_eq!(common::contents(&back), common::contents(&src), "{kind:?}");

    let one = server.get("models", "org/model/config.json");
    assert_eq!(one, std::fs::read(src.join("config.json")).unwrap());
}

#[test]
fn moto_round_trips_with_boto3() {
    round_trip(Kind::S3);
}

#[test]
fn gcs_emulator_round_trips_with_google_cloud_storage() {
    round_trip(Kind::Gcs);
}

#[test]
fn azurite_round_trips_with_azure_storage_blob() {
    round_trip(Kind::Azure);
}

/// Status, headers and whatever body bytes arrived before the connection ended (a truncated
/// body ends in a reset or an early close).
fn raw_request(addr: &str, request_line: &str) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "{request_line}\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response headers");
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head, buf[split + 4..].to_vec())
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[test]
fn reverse_proxy_counts_boto3_bytes_and_injects_throttling() {
    let s3 = ObjectServer::s3();
    s3.create_bucket("bkt");
    let data = common::bytes(5, 1_500_000);
    s3.put_public("bkt", "weights.bin", &data);
    let proxy = Proxy::reverse(&s3.endpoint());

    // boto3 pointed at the proxy: every body byte passes through it and is counted.
    let out = s3.scratch().join("via-proxy");
    run_client(
        Kind::S3,
        &proxy.url(),
        &["get", "bkt", "weights.bin", out.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), data);
    assert_eq!(proxy.bytes_on("/bkt/weights.bin"), data.len() as u64);
    assert_eq!(proxy.stats()["/bkt/weights.bin"].faults, 0);

    // A SlowDown on the object's GET: boto3 retries it (its standard policy) and succeeds.
    proxy.reset_counts();
    proxy.add_fault(
        Fault::new(FaultKind::S3SlowDown)
            .on_path("/bkt/weights.bin")
            .on_method(axum::http::Method::GET),
    );
    std::fs::remove_file(&out).unwrap();
    run_client(
        Kind::S3,
        &proxy.url(),
        &["get", "bkt", "weights.bin", out.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), data);
    let gets: Vec<_> = proxy
        .requests()
        .into_iter()
        .filter(|r| r.method == axum::http::Method::GET && r.path == "/bkt/weights.bin")
        .collect();
    assert_eq!(gets[0].status, 503);
    assert_eq!(gets[0].fault, Some(FaultKind::S3SlowDown));
    assert!(gets[1..].iter().all(|r| r.status < 300), "{gets:#?}");
    assert_eq!(proxy.bytes_on("/bkt/weights.bin"), data.len() as u64);

    // 429 with Retry-After, then the object again once the fault is used up.
    proxy.add_fault(Fault::new(FaultKind::too_many_requests(7)).on_path("weights"));
    let addr = proxy.addr.to_string();
    let (status, head, _) = raw_request(&addr, "GET /bkt/weights.bin HTTP/1.1");
    assert_eq!(status, 429);
    assert_eq!(header(&head, "retry-after"), Some("7"));
    let (status, _, body) = raw_request(&addr, "GET /bkt/weights.bin HTTP/1.1");
    assert_eq!(status, 200);
    assert_eq!(body, data);
}

#[test]
fn forward_proxy_forwards_absolute_urls_and_truncates_on_demand() {
    let s3 = ObjectServer::s3();
    s3.create_bucket("bkt");
    let data = common::bytes(6, 200_000);
    s3.put_public("bkt", "f.bin", &data);
    let proxy = Proxy::forward();
    let addr = proxy.addr.to_string();
    let target = format!("{}/bkt/f.bin", s3.endpoint());

    let (status, _, body) = raw_request(&addr, &format!("GET {target} HTTP/1.1"));
    assert_eq!(status, 200);
    assert_eq!(body, data);
    let rec = &proxy.requests()[0];
    assert_eq!(rec.authority, s3.addr);
    assert_eq!(rec.bytes, data.len() as u64);

    // A body cut after 1000 bytes: Content-Length promises all of it, the connection ends.
    proxy.add_fault(Fault::new(FaultKind::Truncate { after: 1000 }).on_path("f.bin"));
    let (status, head, body) = raw_request(&addr, &format!("GET {target} HTTP/1.1"));
    assert_eq!(status, 200);
    assert_eq!(header(&head, "content-length"), Some("200000"));
    assert_eq!(body, data[..1000]);
    assert_eq!(proxy.stats()["/bkt/f.bin"].bytes, data.len() as u64 + 1000);

    // 500 once, then normal service.
    proxy.add_fault(Fault::new(FaultKind::status(500)));
    let (status, head, _) = raw_request(&addr, &format!("GET {target} HTTP/1.1"));
    assert_eq!((status, header(&head, "retry-after")), (500, None));
    assert_eq!(proxy.faults_injected(), 2);

    // Not a proxy request, and no CONNECT tunnels.
    assert_eq!(raw_request(&addr, "GET /bkt/f.bin HTTP/1.1").0, 400);
    assert_eq!(
        raw_request(&addr, &format!("CONNECT {} HTTP/1.1", s3.addr)).0,
        405
    );
}
