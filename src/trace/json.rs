//! The trace-event JSON of a timeline: one object with `traceEvents`, as Chrome's "Trace Event
//! Format" document describes it: `M` events name the processes and threads, `X` events are
//! spans (`ts` and `dur` in microseconds), `i` events are marks drawn across the timeline.

use std::io::{self, Write};
use std::sync::Arc;

use super::{Args, NONE, TrackData};

/// Writes the events of `tracks` (their processes named by `groups`, numbered from 1).
pub(super) fn write(
    out: impl Write,
    groups: &[String],
    tracks: &[Arc<TrackData>],
    dropped: u64,
) -> io::Result<()> {
    let mut out = out;
    write!(
        out,
        "{{\"displayTimeUnit\":\"ms\",\"otherData\":{{\"producer\":\"gpufeed {}\",\"dropped_events\":{dropped}}},\"traceEvents\":[",
        env!("CARGO_PKG_VERSION")
    )?;
    let mut first = true;
    let mut next = |out: &mut dyn Write| -> io::Result<()> {
        if !std::mem::take(&mut first) {
            out.write_all(b",")?;
        }
        out.write_all(b"\n")
    };
    for (k, name) in groups.iter().enumerate() {
        next(&mut out)?;
        write!(
            out,
            "{{\"ph\":\"M\",\"pid\":{},\"name\":\"process_name\",\"args\":{{\"name\":{}}}}}",
            k + 1,
            quoted(name)
        )?;
    }
    for track in tracks {
        let name = track.name.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (pid, tid) = (track.group, track.id);
        next(&mut out)?;
        write!(
            out,
            "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"name\":\"thread_name\",\"args\":{{\"name\":{}}}}}",
            quoted(&name)
        )?;
        next(&mut out)?;
        write!(
            out,
            "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"name\":\"thread_sort_index\",\"args\":{{\"sort_index\":{}}}}}",
            track.sort
        )?;
        // A copy, so that the track's thread is not held up while the file is written.
        let events = track.lock_events().clone();
        for e in &events {
            next(&mut out)?;
            let ts = micros(e.start);
            match e.dur {
                Some(d) => write!(
                    out,
                    "{{\"ph\":\"X\",\"pid\":{pid},\"tid\":{tid},\"name\":\"{}\",\"ts\":{ts},\"dur\":{}",
                    e.name,
                    micros(d)
                )?,
                None => write!(
                    out,
                    "{{\"ph\":\"i\",\"s\":\"g\",\"pid\":{pid},\"tid\":{tid},\"name\":\"{}\",\"ts\":{ts}",
                    e.name
                )?,
            }
            write_args(&mut out, &e.args)?;
            out.write_all(b"}")?;
        }
    }
    out.write_all(b"\n]}\n")
}

/// `,"args":{...}` with the figures that apply.
fn write_args(out: &mut impl Write, args: &Args) -> io::Result<()> {
    let mut fields = Vec::new();
    if args.epoch != NONE {
        fields.push(format!("\"epoch\":{}", args.epoch));
    }
    if args.batch != NONE {
        fields.push(format!("\"batch\":{}", args.batch));
    }
    if args.parts != u32::MAX {
        fields.push(format!("\"part\":{},\"parts\":{}", args.part, args.parts));
    }
    if args.samples != u32::MAX {
        fields.push(format!("\"samples\":{}", args.samples));
    }
    if args.bytes != NONE {
        fields.push(format!("\"bytes\":{}", args.bytes));
    }
    if fields.is_empty() {
        return Ok(());
    }
    write!(out, ",\"args\":{{{}}}", fields.join(","))
}

/// Nanoseconds as microseconds with three decimals (`12.345`).
fn micros(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

/// `s` as a JSON string.
fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::micros;

    #[test]
    fn nanoseconds_are_written_as_microseconds_with_three_decimals() {
        assert_eq!(micros(0), "0.000");
        assert_eq!(micros(12_345), "12.345");
        assert_eq!(micros(7), "0.007");
        assert_eq!(micros(3_000_000_001), "3000000.001");
    }
}
