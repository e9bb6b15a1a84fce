//! The `grpc-timeout` header (gRPC over HTTP/2 spec: `TimeoutValue TimeoutUnit`,
//! at most 8 digits, units H M S m u n).

use std::time::Duration;

/// Parses a `grpc-timeout` value; `None` when malformed.
pub fn parse(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Encodes a duration as a `grpc-timeout` value (rounded up, 8 digits at most).
pub fn encode(d: Duration) -> String {
    let nanos = d.as_nanos();
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    for (scale, unit) in units {
        let v = nanos.div_ceil(scale);
        if v < 100_000_000 {
            return format!("{v}{unit}");
        }
    }
    "99999999H".to_string()
}

/// Sets the call's `grpc-timeout` to `t` unless it already has a shorter
/// one: the deadline then works as any call's (both ends, every transport,
/// `DEADLINE_EXCEEDED`).
pub(crate) fn cap_grpc_timeout(headers: &mut http::HeaderMap, t: Duration) {
    let current = headers
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse);
    if current.is_some_and(|c| c <= t) {
        return;
    }
    if let Ok(v) = http::HeaderValue::from_str(&encode(t)) {
        headers.insert("grpc-timeout", v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn round_trips_and_rejects_garbage() {
        assert_eq!(parse("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("123456789S"), None);
        assert_eq!(parse("m"), None);
        assert_eq!(parse("-1S"), None);
        assert_eq!(parse("10x"), None);
        for d in [
            Duration::from_nanos(7),
            Duration::from_millis(1500),
            Duration::from_secs(86_400),
        ] {
            assert!(parse(&encode(d)).unwrap() >= d);
        }
    }
}
