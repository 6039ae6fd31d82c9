//! Helpers shared by the GPU tests: open a device or skip, fresh random data, `.npy` files,
//! checking copied rows.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

use gpufeed::cuda::{Device, DeviceLoader, DeviceStats, PinnedBacking};
use gpufeed::{DType, HostPool, Loader, NpyArray};

/// Device 0, or `None` after printing why the test skips. With `GPUFEED_REQUIRE_GPU=1`, no
/// GPU is a failure instead.
pub fn device() -> Option<Device> {
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("GPUFEED_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("GPUFEED_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("skipping: no GPU ({e})");
            None
        }
    }
}

/// A SplitMix64 generator seeded from the clock: fresh inputs on every run (the seed is
/// printed so that a failure can be replayed).
pub struct Rng(u64);

impl Rng {
    pub fn fresh(what: &str) -> Rng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        eprintln!("{what}: seed {seed}");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// A loader over the `row`-byte rows of the `.npy` at `path`, in batches of `batch` shuffled by
/// `seed`, one epoch at a time, on two workers whose host pool holds two batches of pinned
/// memory on `dev`: the copy stage soon needs a block again, so a consumer's slowness shows.
pub fn two_block_loader(dev: &Device, path: &Path, batch: usize, row: usize, seed: u64) -> Loader {
    let block = HostPool::block_size(batch * row) as u64;
    Loader::builder(NpyArray::open(path).unwrap())
        .batch_size(batch)
        .shuffle(seed)
        .workers(2)
        .prefetch(2)
        .pool_budget(2 * block)
        .prefetch_across_epochs(false)
        .backing(PinnedBacking::new(dev))
        .build()
        .unwrap()
}

/// The device loader's figures, printed, once it is checked that the copy stage reused a
/// device block: a test of what happens when a block comes back (under a slow consumer, a
/// held tensor, a poisoned buffer) tested nothing if none did. `what` names the case.
pub fn reused_blocks(dl: &DeviceLoader, what: &str) -> DeviceStats {
    let s = dl.stats();
    eprintln!("{what}: {s}");
    assert!(
        s.device_pool.reuses > 0,
        "{what}: the copy stage never reused a device block, so nothing was tested: {}",
        s.device_pool
    );
    s
}

/// Writes a u8 `.npy` array of `rows` rows of `row_shape`, returns its path and bytes.
pub fn write_npy(
    dir: &Path,
    name: &str,
    rows: u64,
    row_shape: &[u64],
    rng: &mut Rng,
) -> (PathBuf, Vec<u8>) {
    let mut shape = vec![rows];
    shape.extend_from_slice(row_shape);
    let n: u64 = shape.iter().product();
    let mut data = vec![0u8; n as usize];
    rng.fill(&mut data);
    let path = dir.join(name);
    let mut f = std::fs::File::create(&path).expect("create npy");
    f.write_all(&gpufeed::source::npy_header(DType::U8, &shape).expect("header"))
        .expect("write header");
    f.write_all(&data).expect("write data");
    (path, data)
}

/// Checks every sample of a field's bytes `got` (samples `indices`, `row` bytes each) against
/// the source rows `data`.
pub fn check_rows(got: &[u8], indices: &[u64], data: &[u8], row: usize, what: &str) {
    assert_eq!(got.len(), indices.len() * row, "{what}: field size");
    for (pos, &i) in indices.iter().enumerate() {
        let want = &data[i as usize * row..(i as usize + 1) * row];
        let have = &got[pos * row..(pos + 1) * row];
        if have != want {
            let first = have.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            panic!(
                "{what}: sample {i} at position {pos}: byte {first} is {:#x}, want {:#x}",
                have[first], want[first]
            );
        }
    }
}

/// A GPU test: its name (`module::function`), whether it needs a GPU or checks what happens
/// without one, and its body.
pub struct GpuTest {
    pub name: &'static str,
    pub needs_gpu: bool,
    pub run: fn(),
}

/// The GPU test binaries' `main`: runs `tests` with libtest's command line (filters,
/// `--test-threads`, `-q`, `--include-ignored`). Without a GPU every test that needs one is
/// reported as *ignored*, with the reason printed once, so that a summary never says a GPU
/// path passed where none ran; with `GPUFEED_REQUIRE_GPU=1` no GPU fails the run instead.
pub fn run_gpu_tests(tests: Vec<GpuTest>) -> std::process::ExitCode {
    let args = libtest_mimic::Arguments::from_args();
    let no_gpu = Device::open(0).err().map(|e| e.to_string());
    if let Some(why) = &no_gpu {
        if std::env::var("GPUFEED_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("GPUFEED_REQUIRE_GPU=1 but no GPU: {why}");
            return std::process::ExitCode::FAILURE;
        }
        let ignored = tests.iter().filter(|t| t.needs_gpu).count();
        eprintln!("no GPU ({why}): {ignored} tests that need one are reported as ignored");
    }
    let trials = tests
        .into_iter()
        .map(|t| {
            let run = t.run;
            libtest_mimic::Trial::test(t.name, move || {
                run();
                Ok(())
            })
            .with_ignored_flag(t.needs_gpu && no_gpu.is_some())
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// The list of [`GpuTest`]s of some modules: `gpu_tests![module: [a, b], other: [c]]`; a
/// function named in `without_gpu: [...]` of its module runs with or without a GPU.
#[macro_export]
macro_rules! gpu_tests {
    ($($module:ident: [$($test:ident),* $(,)?] $(without_gpu: [$($cpu:ident),* $(,)?])?),* $(,)?) => {
        vec![
            $(
                $($crate::cuda_common::GpuTest {
                    name: concat!(stringify!($module), "::", stringify!($test)),
                    needs_gpu: true,
                    run: $module::$test,
                },)*
                $($($crate::cuda_common::GpuTest {
                    name: concat!(stringify!($module), "::", stringify!($cpu)),
                    needs_gpu: false,
                    run: $module::$cpu,
                },)*)?
            )*
        ]
    };
}
