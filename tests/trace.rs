//! The loader's timeline (`gpufeed::trace`): valid trace-event JSON, spans nested per thread,
//! every batch in every stage exactly once.

use std::collections::BTreeMap;

use gpufeed::format::{DType, Field, Schema};
use gpufeed::trace::Trace;
use gpufeed::{BatchStream, Dataset, Error, Loader, Result, Sample};
use serde_json::Value;

/// Sample i: the u64 `i`.
struct Numbers(Vec<u8>, Schema);

impl Numbers {
    fn new(n: u64) -> Numbers {
        let schema = Schema::new(vec![Field::tensor("x", DType::U64, &[])]).unwrap();
        Numbers((0..n).flat_map(|i| i.to_le_bytes()).collect(), schema)
    }
}

impl Dataset for Numbers {
    fn len(&self) -> u64 {
        self.0.len() as u64 / 8
    }
    fn schema(&self) -> &Schema {
        &self.1
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let i = index as usize;
        let bytes = self.0.get(i * 8..i * 8 + 8).ok_or(Error::OutOfRange {
            index,
            len: self.len(),
        })?;
        Sample::borrowed(bytes, &self.1)
    }
}

/// A span of the trace: (name, start, end) in microseconds, with its args.
struct Span {
    name: String,
    start: f64,
    end: f64,
    args: Value,
}

/// Thread names and spans of a trace, by (pid, tid), and the marks' names.
type Parsed = (
    BTreeMap<(u64, u64), String>,
    BTreeMap<(u64, u64), Vec<Span>>,
    Vec<String>,
);

/// Parses a trace the way a viewer reads it, checking the schema of every event; returns the
/// thread names by (pid, tid), the spans by (pid, tid), and the marks' names.
fn parse(text: &str) -> Parsed {
    let doc: Value = serde_json::from_str(text).expect("the trace is JSON");
    assert_eq!(doc["otherData"]["dropped_events"], 0);
    let events = doc["traceEvents"]
        .as_array()
        .expect("traceEvents is an array");
    let (mut names, mut spans, mut marks) = (BTreeMap::new(), BTreeMap::new(), Vec::new());
    let mut processes = 0;
    for e in events {
        let ph = e["ph"].as_str().expect("every event has a phase");
        let name = e["name"]
            .as_str()
            .expect("every event has a name")
            .to_owned();
        let pid = e["pid"].as_u64().expect("every event has a pid");
        match ph {
            "M" => match name.as_str() {
                "process_name" => {
                    assert!(e["args"]["name"].is_string());
                    processes += 1;
                }
                "thread_name" => {
                    let tid = e["tid"].as_u64().expect("a thread has a tid");
                    let thread = e["args"]["name"].as_str().expect("a thread's name");
                    assert!(names.insert((pid, tid), thread.to_owned()).is_none());
                }
                "thread_sort_index" => assert!(e["args"]["sort_index"].is_i64()),
                other => panic!("unknown metadata event {other}"),
            },
            "X" | "i" => {
                let tid = e["tid"].as_u64().expect("an event has a tid");
                let ts = e["ts"].as_f64().expect("an event has a ts");
                assert!(ts >= 0.0, "{e}");
                if ph == "i" {
                    assert_eq!(e["s"], "g", "marks are drawn across the timeline");
                    marks.push(name);
                    continue;
                }
                let dur = e["dur"].as_f64().expect("a span has a dur");
                assert!(dur >= 0.0, "{e}");
                spans.entry((pid, tid)).or_insert_with(Vec::new).push(Span {
                    name,
                    start: ts,
                    end: ts + dur,
                    args: e["args"].clone(),
                });
            }
            other => panic!("unknown phase {other}"),
        }
    }
    assert_eq!(processes, 1, "one loader, one process");
    for key in spans.keys() {
        assert!(names.contains_key(key), "every track is named");
    }
    (names, spans, marks)
}

/// Checks that the spans of each thread nest: any two are disjoint or one holds the other.
fn check_nesting(spans: &BTreeMap<(u64, u64), Vec<Span>>) {
    const EPS: f64 = 1e-3; // the file's resolution: a nanosecond
    for (track, spans) in spans {
        let mut sorted: Vec<&Span> = spans.iter().collect();
        sorted.sort_by(|a, b| a.start.total_cmp(&b.start).then(b.end.total_cmp(&a.end)));
        let mut open: Vec<&Span> = Vec::new();
        for s in sorted {
            while open.last().is_some_and(|top| top.end <= s.start + EPS) {
                open.pop();
            }
            if let Some(top) = open.last() {
                assert!(
                    s.end <= top.end + EPS,
                    "track {track:?}: {} [{}, {}] overlaps {} [{}, {}] without nesting",
                    s.name,
                    s.start,
                    s.end,
                    top.name,
                    top.start,
                    top.end
                );
            }
            open.push(s);
        }
    }
}

/// How many spans named `name` each (epoch, batch) has, over every thread.
fn per_batch(spans: &BTreeMap<(u64, u64), Vec<Span>>, name: &str) -> BTreeMap<(u64, u64), usize> {
    let mut n = BTreeMap::new();
    for s in spans.values().flatten().filter(|s| s.name == name) {
        let key = (
            s.args["epoch"].as_u64().expect("an epoch"),
            s.args["batch"].as_u64().expect("a batch"),
        );
        *n.entry(key).or_insert(0) += 1;
    }
    n
}

/// Runs `epochs` epochs of a loader of 2 workers over 100 samples in batches of 8 (13 an
/// epoch) made in `parts` parts, with a trace; returns the trace's text.
fn traced_run(parts: usize, epochs: u64) -> String {
    let trace = Trace::new();
    let mut loader = Loader::builder(Numbers::new(100))
        .batch_size(8)
        .shuffle(3)
        .workers(2)
        .batch_parts(parts)
        .trace(&trace)
        .build()
        .unwrap();
    for epoch in 0..epochs {
        loader.set_epoch(epoch);
        let mut seen = 0;
        for batch in loader.by_ref() {
            seen += batch.unwrap().len();
        }
        assert_eq!(seen, 100);
    }
    drop(loader);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.trace.json");
    trace.write(&path).unwrap();
    std::fs::read_to_string(&path).unwrap()
}

#[test]
fn a_trace_is_trace_event_json_with_spans_nested_and_every_batch_in_every_stage_once() {
    for parts in [1, 3] {
        let text = traced_run(parts, 3);
        let (names, spans, marks) = parse(&text);
        let mut threads: Vec<&str> = names.values().map(String::as_str).collect();
        threads.sort_unstable();
        assert_eq!(threads, ["consumer", "worker 0", "worker 1"]);
        check_nesting(&spans);
        // Every batch of the three epochs, in every stage, exactly once (per part for the
        // stages of a part). Batches of epoch 3 are made ahead: they may be there too.
        let every: Vec<(u64, u64)> = (0..3).flat_map(|e| (0..13).map(move |b| (e, b))).collect();
        let whole = if parts == 1 { "batch" } else { "part" };
        for (stage, times) in [
            (whole, parts),
            ("fetch", parts),
            ("transform", parts),
            ("buffer", 1),
            ("collate", 1),
            ("holding", 1),
        ] {
            let counts = per_batch(&spans, stage);
            for key in &every {
                assert_eq!(
                    counts.get(key),
                    Some(&times),
                    "{stage} of {key:?}, {parts} parts"
                );
            }
            let stray: Vec<_> = counts.keys().filter(|(e, _)| *e > 3).collect();
            assert!(stray.is_empty(), "{stage}: {stray:?}");
        }
        // Fetch and transform spans say how many samples they cover: the batch's, in all.
        let mut samples = BTreeMap::new();
        for s in spans.values().flatten().filter(|s| s.name == "fetch") {
            let key = (
                s.args["epoch"].as_u64().unwrap(),
                s.args["batch"].as_u64().unwrap(),
            );
            *samples.entry(key).or_insert(0) += s.args["samples"].as_u64().unwrap();
        }
        for &(e, b) in &every {
            assert_eq!(samples[&(e, b)], if b == 12 { 4 } else { 8 }, "batch {b}");
        }
        // Spans live on their threads: stages on the workers, waits on the consumer.
        for (key, spans) in &spans {
            let thread = &names[key];
            for s in spans {
                let on_worker = [
                    "batch",
                    "part",
                    "buffer",
                    "fetch",
                    "transform",
                    "collate",
                    "warm",
                    "allocate",
                ];
                if thread == "consumer" {
                    assert!(
                        ["waiting", "holding"].contains(&s.name.as_str()),
                        "{}",
                        s.name
                    );
                } else {
                    assert!(on_worker.contains(&s.name.as_str()), "{thread}: {}", s.name);
                }
            }
        }
        assert!(!per_batch(&spans, "waiting").is_empty());
        // The pool's allocations, on the workers that made them.
        let allocations = spans
            .values()
            .flatten()
            .filter(|s| s.name == "allocate")
            .count();
        assert!(allocations >= 1, "the pool allocated at least one buffer");
        // Epochs 0, 1 and 2 are marked.
        assert_eq!(marks.iter().filter(|m| *m == "epoch").count(), 3);
    }
}

#[test]
fn a_trace_written_while_its_loader_runs_is_whole_json_and_refuses_a_directory() {
    let trace = Trace::new();
    let mut loader = Loader::builder(Numbers::new(64))
        .batch_size(8)
        .workers(2)
        .trace(&trace)
        .build()
        .unwrap();
    let _first = loader.next().unwrap().unwrap();
    let mut text = Vec::new();
    trace.write_to(&mut text).unwrap();
    let (_, spans, _) = parse(std::str::from_utf8(&text).unwrap());
    check_nesting(&spans);
    let dir = tempfile::tempdir().unwrap();
    let err = trace.write(dir.path()).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "no temporary left"
    );
}
