//! The GPU path at the edges of an epoch: no batch lost at the budget, resume and set_epoch
//! on `DeviceLoader` as on `Loader`. Each test skips without a GPU.

use crate::cuda_common;
use gpufeed::BatchStream;

use std::collections::VecDeque;

use gpufeed::cuda::{DeviceBatch, DeviceLoader, DeviceLoaderOptions};
use gpufeed::{HostPool, Loader, LoaderState, NpyArray};

use cuda_common::{Rng, check_rows, device, write_npy};

/// What a delivered batch was: (epoch, number, indices), its bytes checked against the file.
type Seen = (u64, u64, Vec<u64>);

/// The README's loop on a `DeviceLoader`: `set_epoch` at the top of each epoch, stopping after
/// `stop` batches in all when given, while holding the last `hold` device batches.
fn readme_loop(
    dl: &mut DeviceLoader,
    start: u64,
    end: u64,
    stop: Option<usize>,
    hold: usize,
    data: &[u8],
    row: usize,
) -> Vec<Seen> {
    let mut out = Vec::new();
    let mut held: VecDeque<DeviceBatch> = VecDeque::new();
    for epoch in start..end {
        dl.set_epoch(epoch);
        loop {
            if stop == Some(out.len()) {
                return out;
            }
            let Some(batch) = dl.next() else { break };
            let batch = batch.unwrap();
            check_rows(
                &batch.field_to_host("data").unwrap(),
                batch.indices(),
                data,
                row,
                "resume",
            );
            out.push((batch.epoch(), batch.number(), batch.indices().to_vec()));
            held.push_back(batch);
            while held.len() > hold {
                held.pop_front();
            }
        }
    }
    out
}

pub fn device_loaders_resume_exactly_through_the_readme_loop_twice() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("device resume");
    let (path, data) = write_npy(dir.path(), "x.npy", 203, &[64], &mut rng);
    let seed = rng.next_u64();
    let build = |workers: usize, prefetch: usize, state: Option<LoaderState>| {
        let mut b = Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(16)
            .shuffle(seed)
            .workers(workers)
            .prefetch(prefetch);
        if let Some(s) = state {
            b = b.resume(s);
        }
        DeviceLoader::from_builder(b, &dev, DeviceLoaderOptions::default().depth(2)).unwrap()
    };
    const EPOCHS: u64 = 3;
    let whole = readme_loop(&mut build(2, 4, None), 0, EPOCHS, None, 0, &data, 64);
    assert_eq!(whole.len(), 13 * 3);
    for case in 0..6u64 {
        let stop1 = (rng.next_u64() % whole.len() as u64) as usize;
        let hold = (case % 3) as usize;
        let mut run = build(1 + (case % 3) as usize, 1 + (case % 4) as usize, None);
        let mut got = readme_loop(&mut run, 0, EPOCHS, Some(stop1), hold, &data, 64);
        let state = run.state();
        drop(run);
        let stop2 = (rng.next_u64() % (whole.len() - got.len()) as u64) as usize;
        let mut run = build(3, 2, Some(state.clone()));
        got.extend(readme_loop(
            &mut run,
            state.epoch,
            EPOCHS,
            Some(stop2),
            hold,
            &data,
            64,
        ));
        let state = serde_json::to_string(&run.state()).unwrap();
        drop(run);
        let state: LoaderState = serde_json::from_str(&state).unwrap();
        let mut run = build(2, 5, Some(state.clone()));
        got.extend(readme_loop(
            &mut run,
            state.epoch,
            EPOCHS,
            None,
            0,
            &data,
            64,
        ));
        assert_eq!(
            got, whole,
            "case {case}: stops at {stop1} then {stop2}, holding {hold}"
        );
    }
}

pub fn load_state_on_a_running_device_loader_continues_from_the_state() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("device load_state");
    let (path, data) = write_npy(dir.path(), "x.npy", 100, &[8], &mut rng);
    let b = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(10)
        .shuffle(5)
        .workers(2);
    let mut dl = DeviceLoader::from_builder(b, &dev, DeviceLoaderOptions::default()).unwrap();
    let whole = readme_loop(&mut dl, 0, 2, None, 0, &data, 8);
    dl.set_epoch(0);
    let _ = dl.next();
    let mut state = dl.state();
    assert_eq!((state.epoch, state.next_batch), (0, 1));
    state.epoch = 1;
    state.next_batch = 6;
    dl.load_state(state).unwrap();
    let rest = readme_loop(&mut dl, 1, 2, None, 0, &data, 8);
    assert_eq!(rest, whole[16..]);
}

pub fn a_host_budget_of_one_batch_delivers_every_device_batch() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("device budget");
    let (path, data) = write_npy(dir.path(), "x.npy", 120, &[100], &mut rng);
    let one = HostPool::block_size(10 * 100) as u64;
    let b = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(10)
        .workers(2)
        .pool_budget(one);
    let mut dl = DeviceLoader::from_builder(b, &dev, DeviceLoaderOptions::default()).unwrap();
    // The consumer keeps every device batch: device memory is not under the host budget.
    let all: Vec<DeviceBatch> = dl.by_ref().map(|b| b.unwrap()).collect();
    assert_eq!(all.len(), 12);
    for (k, b) in all.iter().enumerate() {
        assert_eq!(b.number(), k as u64);
        check_rows(
            &b.field_to_host("data").unwrap(),
            b.indices(),
            &data,
            100,
            "budget",
        );
    }
}

pub fn evaluation_masks_travel_with_device_batches() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("device evaluation");
    let (path, _) = write_npy(dir.path(), "x.npy", 10, &[4], &mut rng);
    let mut real = Vec::new();
    for rank in 0..3 {
        let b = Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(2)
            .shard(rank, 3)
            .evaluation(true);
        let dl = DeviceLoader::from_builder(b, &dev, DeviceLoaderOptions::default()).unwrap();
        let batches: Vec<DeviceBatch> = dl.map(|b| b.unwrap()).collect();
        assert_eq!(batches.len(), 2, "4 slots per rank in batches of 2");
        for b in &batches {
            real.extend(
                b.indices()
                    .iter()
                    .zip(b.mask())
                    .filter(|x| x.1)
                    .map(|x| *x.0),
            );
        }
    }
    real.sort_unstable();
    assert_eq!(real, (0..10).collect::<Vec<_>>());
}
