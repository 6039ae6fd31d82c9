//! Where does a first epoch's time go? Measures, one by one and on the machine it runs on, the
//! costs that a loader's first epoch pays and its later epochs do not:
//!
//! - creating the CUDA context and a stream;
//! - allocating pinned host memory (`cuMemHostAlloc`) against mapping anonymous memory and
//!   registering it (`cuMemHostRegister`), with and without transparent huge pages;
//! - the first CPU writes into fresh pinned memory against later writes;
//! - the first host-to-device copy from fresh pinned memory against later copies;
//! - page faults on a fresh mapping of a data file (page cache warm) against a mapping already
//!   faulted in, and what `MAP_POPULATE` and `madvise(WILLNEED)` change;
//! - starting worker threads.
//!
//! ```text
//! cargo run --release --features cuda --example first_epoch_probe -- FILE [--buffers 34] [--buffer-bytes 38535168] [--threads 16]
//! ```
//!
//! Prints one JSON object per measurement. It reads FILE (a data set the loader reads, warm in
//! the page cache) and never writes it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    probe::main()
}

mod probe {
    use std::ffi::c_void;
    use std::time::Instant;

    use cudarc::driver::{CudaContext, result, sys};
    use memmap2::{Advice, MmapMut, MmapOptions};

    struct Args {
        file: String,
        buffers: usize,
        buffer_bytes: usize,
        threads: usize,
    }

    fn parse() -> Result<Args, String> {
        let mut args = Args {
            file: String::new(),
            buffers: 34,
            buffer_bytes: (256 * 150_528usize).next_multiple_of(4096),
            threads: 16,
        };
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            let mut value = |name: &str| -> Result<usize, String> {
                it.next()
                    .and_then(|v| v.parse().ok())
                    .ok_or(format!("{name} needs a whole number"))
            };
            match a.as_str() {
                "--buffers" => args.buffers = value("--buffers")?,
                "--buffer-bytes" => args.buffer_bytes = value("--buffer-bytes")?,
                "--threads" => args.threads = value("--threads")?.max(1),
                _ if a.starts_with("--") => return Err(format!("unknown flag {a}")),
                _ => args.file = a,
            }
        }
        if args.file.is_empty() {
            return Err(
                "usage: first_epoch_probe FILE [--buffers N] [--buffer-bytes B] [--threads T]"
                    .into(),
            );
        }
        Ok(args)
    }

    fn report(what: &str, fields: &[(&str, f64)]) {
        let mut line = format!("{{\"what\":\"{what}\"");
        for (k, v) in fields {
            line.push_str(&format!(",\"{k}\":{v:.4}"));
        }
        line.push('}');
        println!("{line}");
    }

    fn ms(t: Instant) -> f64 {
        t.elapsed().as_secs_f64() * 1e3
    }

    fn check(r: sys::CUresult, what: &str) -> Result<(), String> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {r:?}"))
        }
    }

    /// Times `n` copies of `bytes` from each host buffer to one device buffer, on `stream`,
    /// with events around each copy; returns the per-copy GB/s.
    fn copy_rates(
        ctx: &std::sync::Arc<CudaContext>,
        stream: sys::CUstream,
        dst: sys::CUdeviceptr,
        hosts: &[*mut u8],
        bytes: usize,
    ) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
        let mut rates = Vec::new();
        for &h in hosts {
            let start = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let end = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            // SAFETY: `h` points to `bytes` bytes of pinned memory owned by the caller until
            // after the synchronisation below; `dst` is a device buffer of at least `bytes`.
            unsafe {
                result::event::record(start.cu_event(), stream)?;
                let src = std::slice::from_raw_parts(h, bytes);
                result::memcpy_htod_async(dst, src, stream)?;
                result::event::record(end.cu_event(), stream)?;
                result::stream::synchronize(stream)?;
                let ms = result::event::elapsed(start.cu_event(), end.cu_event())?;
                rates.push(bytes as f64 / (f64::from(ms) * 1e-3) / 1e9);
            }
        }
        Ok(rates)
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    /// Reads one byte of every page of `bytes` from `threads` threads, each a contiguous part:
    /// the page faults of a first pass over a mapping, or none on a later pass.
    fn touch_pages(bytes: &[u8], threads: usize) -> u64 {
        let chunk = bytes.len().div_ceil(threads);
        std::thread::scope(|s| {
            let hs: Vec<_> = bytes
                .chunks(chunk.max(1))
                .map(|part| {
                    s.spawn(move || {
                        let mut sum = 0u64;
                        for page in part.chunks(4096) {
                            sum = sum.wrapping_add(u64::from(page[0]));
                        }
                        sum
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        })
    }

    pub fn main() -> Result<(), Box<dyn std::error::Error>> {
        let args = parse()?;
        let n = args.buffers;
        let b = args.buffer_bytes;

        // Threads: what starting the loader's workers costs.
        let t = Instant::now();
        let hs: Vec<_> = (0..args.threads)
            .map(|_| std::thread::spawn(|| {}))
            .collect();
        for h in hs {
            let _ = h.join();
        }
        report(
            "start_join_threads",
            &[("threads", args.threads as f64), ("ms", ms(t))],
        );

        // The context.
        let t = Instant::now();
        result::init()?;
        report("cu_init", &[("ms", ms(t))]);
        let t = Instant::now();
        let ctx = CudaContext::new(0)?;
        report("context_create", &[("ms", ms(t))]);
        let t = Instant::now();
        let stream = ctx.new_stream()?;
        report("stream_create", &[("ms", ms(t))]);
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation in the current context, freed at the end.
        let dst = unsafe { result::malloc_sync(b)? };

        // Pinned allocation, buffer by buffer.
        let mut pinned = Vec::with_capacity(n);
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            // SAFETY: a plain pinned allocation (PORTABLE, as gpufeed's PinnedBacking); freed
            // below.
            let p = unsafe { result::malloc_host(b, sys::CU_MEMHOSTALLOC_PORTABLE)? };
            times.push(ms(t));
            pinned.push(p.cast::<u8>());
        }
        report(
            "cuMemHostAlloc",
            &[
                ("buffers", n as f64),
                ("bytes_each", b as f64),
                ("ms_total", times.iter().sum()),
                ("ms_first", times[0]),
                ("ms_mean", mean(&times)),
                (
                    "gb_per_s",
                    (n * b) as f64 / (times.iter().sum::<f64>() * 1e-3) / 1e9,
                ),
            ],
        );

        // First and second CPU write into pinned memory (one thread, then `threads`).
        for pass in ["first", "second"] {
            let t = Instant::now();
            for &p in &pinned[..n.min(4)] {
                // SAFETY: `p` is a live pinned block of `b` bytes that nothing else uses.
                unsafe { std::ptr::write_bytes(p, 0xA5, b) };
            }
            let secs = t.elapsed().as_secs_f64();
            report(
                &format!("pinned_write_{pass}_1_thread"),
                &[("gb_per_s", (n.min(4) * b) as f64 / secs / 1e9)],
            );
        }

        // First and later copies from those pinned buffers.
        let first = copy_rates(&ctx, stream.cu_stream(), dst, &pinned, b)?;
        let second = copy_rates(&ctx, stream.cu_stream(), dst, &pinned, b)?;
        report(
            "h2d_from_cuMemHostAlloc",
            &[
                ("first_copy_gb_per_s_mean", mean(&first)),
                ("first_copy_gb_per_s_buffer0", first[0]),
                ("second_copy_gb_per_s_mean", mean(&second)),
            ],
        );

        // The same through mmap + cuMemHostRegister, without and with huge pages.
        for huge in [false, true] {
            let t = Instant::now();
            let mut maps: Vec<MmapMut> = Vec::with_capacity(n);
            for _ in 0..n {
                let m = MmapOptions::new().len(b).map_anon()?;
                if huge {
                    let _ = m.advise(Advice::HugePage);
                }
                maps.push(m);
            }
            let t_map = ms(t);
            let t = Instant::now();
            for m in &mut maps {
                m.fill(0);
            }
            let t_touch = ms(t);
            let t = Instant::now();
            for m in &mut maps {
                // SAFETY: the mapping is live and `b` bytes long; it is unregistered below
                // before it is unmapped.
                let registered = unsafe {
                    sys::cuMemHostRegister_v2(
                        m.as_mut_ptr().cast::<c_void>(),
                        b,
                        sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                check(registered, "cuMemHostRegister")?;
            }
            let t_register = ms(t);
            let ptrs: Vec<*mut u8> = maps.iter_mut().map(|m| m.as_mut_ptr()).collect();
            let first = copy_rates(&ctx, stream.cu_stream(), dst, &ptrs, b)?;
            let second = copy_rates(&ctx, stream.cu_stream(), dst, &ptrs, b)?;
            report(
                if huge {
                    "mmap_hugepage_touch_register"
                } else {
                    "mmap_touch_register"
                },
                &[
                    ("ms_map", t_map),
                    ("ms_touch", t_touch),
                    ("ms_register", t_register),
                    (
                        "gb_per_s_map_touch_register",
                        (n * b) as f64 / ((t_map + t_touch + t_register) * 1e-3) / 1e9,
                    ),
                    ("first_copy_gb_per_s_mean", mean(&first)),
                    ("second_copy_gb_per_s_mean", mean(&second)),
                ],
            );
            for m in &mut maps {
                // SAFETY: registered above, unregistered once.
                let _ = unsafe { sys::cuMemHostUnregister(m.as_mut_ptr().cast::<c_void>()) };
            }
        }

        // Pinned allocation from several threads at once: does the driver serialise it?
        let t = Instant::now();
        let parallel: Vec<usize> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..args.threads.min(n))
                .map(|_| {
                    let ctx = &ctx;
                    s.spawn(move || {
                        let _ = ctx.bind_to_thread();
                        // SAFETY: as above; freed below.
                        unsafe { result::malloc_host(b, sys::CU_MEMHOSTALLOC_PORTABLE) }
                            .map_or(0, |p| p as usize)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let t_par = ms(t);
        report(
            "cuMemHostAlloc_parallel",
            &[
                ("threads", args.threads.min(n) as f64),
                ("ms_total", t_par),
                (
                    "gb_per_s",
                    (parallel.len() * b) as f64 / (t_par * 1e-3) / 1e9,
                ),
            ],
        );
        for p in parallel.into_iter().filter(|&p| p != 0) {
            // SAFETY: allocated above by malloc_host, freed once.
            let _ = unsafe { result::free_host(p as *mut c_void) };
        }
        for p in pinned {
            // SAFETY: allocated above by malloc_host, freed once.
            let _ = unsafe { result::free_host(p.cast()) };
        }
        // SAFETY: allocated above, no work pending on it (the stream was synchronised).
        let _ = unsafe { result::free_sync(dst) };

        // The data file's mapping: a fresh mapping faults every page in once.
        let file = std::fs::File::open(&args.file)?;
        let len = file.metadata()?.len() as f64;
        for (name, populate, willneed) in [
            ("mmap_first_pass", false, false),
            ("mmap_populate", true, false),
            ("mmap_willneed", false, true),
        ] {
            let t = Instant::now();
            // SAFETY: a read-only mapping of a file nobody writes during the probe.
            let map = unsafe {
                let mut o = MmapOptions::new();
                if populate {
                    o.populate();
                }
                o.map(&file)?
            };
            if willneed {
                let _ = map.advise(Advice::WillNeed);
            }
            let t_map = ms(t);
            let t = Instant::now();
            let _ = touch_pages(&map, args.threads);
            let t_first = ms(t);
            let t = Instant::now();
            let _ = touch_pages(&map, args.threads);
            let t_second = ms(t);
            report(
                name,
                &[
                    ("bytes", len),
                    ("ms_map", t_map),
                    ("ms_first_touch", t_first),
                    ("ms_second_touch", t_second),
                    ("threads", args.threads as f64),
                ],
            );
        }
        Ok(())
    }
}
