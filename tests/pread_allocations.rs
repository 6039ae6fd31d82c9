//! `ReadMode::Pread`'s path into the batch slot allocates nothing per sample:
//! counted by a global allocator, over `get` + `copy_field_into` of every field (what
//! `CopyFields` does), for a packed file and a `.npy` array. The reads through a buffer (a
//! checksum to verify, a transform that wants bytes) reuse a per-thread buffer: nothing either
//! once it is warm.
//!
//! One test in this binary, so that no other test allocates while it counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use gpufeed::format::{DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema};
use gpufeed::source::npy_header;
use gpufeed::{Dataset, NpyArray};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by `f`.
fn allocations(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    f();
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

/// Reads every sample of `d` into slots: `get` then `copy_field_into` for each field.
fn copy_all(d: &dyn Dataset, slots: &mut [Vec<u8>]) {
    for i in 0..d.len() {
        let s = d.get(i).unwrap();
        for (k, slot) in slots.iter_mut().enumerate() {
            s.copy_field_into(k, slot).unwrap();
        }
    }
}

/// Reads every sample's fields as bytes.
fn read_all(d: &dyn Dataset) -> u64 {
    let mut sum = 0u64;
    for i in 0..d.len() {
        let s = d.get(i).unwrap();
        for k in 0..d.schema().fields().len() {
            sum += u64::from(s.try_field(k).unwrap()[0]);
        }
    }
    sum
}

#[test]
fn reading_into_slots_allocates_nothing_per_sample() {
    assert_eq!(
        allocations(|| drop(std::hint::black_box(vec![1u8; 64]))),
        1,
        "the counter counts"
    );
    let dir = tempfile::tempdir().unwrap();
    let gfd = dir.path().join("f.gfd");
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &[3, 32, 32]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .unwrap();
    let mut w = RecordWriter::create(&gfd, schema).unwrap();
    for i in 0..200u32 {
        w.append(&[&[i as u8; 3072], &i.to_le_bytes()]).unwrap();
    }
    w.finish().unwrap();
    let npy = dir.path().join("a.npy");
    let mut b = npy_header(DType::U8, &[200, 3072]).unwrap();
    b.resize(b.len() + 200 * 3072, 9);
    std::fs::write(&npy, b).unwrap();

    for verify in [false, true] {
        let options = ReadOptions {
            mode: ReadMode::Pread,
            verify_checksums: verify,
        };
        let file = RecordFile::open_with(&gfd, options).unwrap();
        let mut slots = vec![vec![0u8; 3072], vec![0u8; 4]];
        copy_all(&file, &mut slots); // warm: the per-thread buffer (verify)
        let n = allocations(|| copy_all(&file, &mut slots));
        assert_eq!(n, 0, "{n} allocations over 200 samples (verify {verify})");
        assert_eq!(slots[1], 199u32.to_le_bytes());
        read_all(&file);
        let n = allocations(|| {
            read_all(&file);
        });
        assert_eq!(n, 0, "{n} allocations reading bytes (verify {verify})");
    }
    let array = NpyArray::open_with(&npy, "data", ReadMode::Pread).unwrap();
    let mut slots = vec![vec![0u8; 3072]];
    let n = allocations(|| copy_all(&array, &mut slots));
    assert_eq!(n, 0, "{n} allocations over 200 rows");
    assert!(slots[0].iter().all(|&v| v == 9));
}
