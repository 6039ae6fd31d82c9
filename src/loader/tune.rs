//! Settings the loader chooses itself ([`Setting::Auto`]): the workers from a short
//! measurement on the first batches, and the batches in flight and the parts from the workers
//! chosen, within a CPU budget and a memory budget.
//!
//! How workers are chosen. The loader starts as many worker threads as the CPU budget holds
//! ([`CpuBudget`]) and lets only some of them take tasks (a [`Gate`]). It tries the candidate
//! counts in turn, most first (1, 2, 4, ... up to the budget, and the default), each for a
//! short while on the batches it is making anyway: after the tasks begun under the previous
//! count have ended, it measures the samples the workers wrote over the time they spent writing
//! them (fetch and transform, summed over the workers). Times the active workers, that is what
//! this count can make per second however fast the consumer is (its capacity); memory
//! bandwidth shared by the workers, or a CPU shared with the consumer, shows up as each
//! worker's writing taking longer. The consumer's own rate (samples over the time it did not
//! wait) bounds what any count can deliver. [`choose`] then takes the fewest workers whose
//! rate, so bounded, is within [`TOLERANCE`] of the best: a pure function of the measured
//! rates. The other threads stop.
//!
//! Going down stops early ([`past_the_knee`]): once a count measures below the tolerance of
//! the best and below the count before it, the rate is falling with the workers, and fewer
//! still would make less; they are not measured. Measuring them would cost the most (a trial
//! of one worker is the slowest stretch of the run) and could not change the choice. A rate
//! that rises as workers go (more threads than the CPUs can run) goes on down.
//!
//! Bounded in time: a count is measured for at most [`TRIAL_LIMIT`], and the whole choice takes
//! at most [`TUNE_LIMIT`]; the counts not measured by then are not chosen. No batch is made
//! twice or held back: the measured batches are the run's first batches, delivered as usual.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::sizing::{CpuBudget, default_parts, default_prefetch};
use crate::memory::human_bytes;

/// A loader setting: a number, or [`Setting::Auto`]: chosen by the loader (see
/// [`LoaderBuilder::workers`](super::LoaderBuilder::workers)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// This many.
    Fixed(usize),
    /// Chosen by the loader: the workers from a measurement on the first batches, the batches
    /// in flight and the parts from the workers chosen.
    Auto,
}

/// [`Setting::Auto`], spelled short: `.workers(Auto)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Auto;

impl From<usize> for Setting {
    fn from(n: usize) -> Setting {
        Setting::Fixed(n)
    }
}

impl From<Auto> for Setting {
    fn from(_: Auto) -> Setting {
        Setting::Auto
    }
}

/// A count within this fraction of the best measured rate counts as good as the best: the
/// fewest workers that reach it are chosen.
pub(crate) const TOLERANCE: f64 = 0.03;

/// The longest one candidate count is measured (its settling included).
pub(crate) const TRIAL_LIMIT: Duration = Duration::from_secs(1);

/// The longest the choice of workers takes, all candidates together.
pub const TUNE_LIMIT: Duration = Duration::from_secs(4);

/// A candidate is measured at least this long...
///
/// Short, because a trial of fewer workers than the choice costs the run its rate: on the
/// H200, 16 workers make 4 KB records at about 50 GB/s, and each 60 ms spent on 8 was 30 ms
/// of the whole lost. The rate is of the workers' busy time, so a short trial with many
/// batches measures it as well as a long one.
const TRIAL_MIN: Duration = Duration::from_millis(20);

/// ... and over at least this many batches or parts per active worker.
const TRIAL_FILLS_PER_WORKER: u64 = 2;

/// One candidate count of workers, measured.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Trial {
    /// Workers taking tasks.
    pub workers: usize,
    /// What they made per second of their writing time, times the workers (samples/s).
    pub samples_per_sec: f64,
    /// Batches or parts measured.
    pub fills: u64,
    /// Seconds measured.
    pub seconds: f64,
}

/// Why the loader chose the workers it chose.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    /// The count measured fastest.
    Fastest,
    /// Fewer workers than the fastest count, within 3% of its rate: the fewest that come so
    /// close.
    FewestWithinTolerance,
    /// The consumer takes fewer samples per second than these workers make: more would wait.
    ConsumerBound,
}

/// Chooses among measured `trials`, given the consumer's rate (`demand`, samples per second of
/// the time it did not wait; `None` when unknown): the fewest workers whose rate, bounded by
/// the consumer's, is within [`TOLERANCE`] of the best. `None` without trials. Deterministic:
/// the same rates give the same choice.
pub(crate) fn choose(trials: &[Trial], demand: Option<f64>) -> Option<(usize, Choice)> {
    let bound = demand.filter(|d| d.is_finite() && *d > 0.0);
    let effective = |t: &Trial| match bound {
        Some(d) => t.samples_per_sec.min(d),
        None => t.samples_per_sec,
    };
    let best = trials.iter().max_by(|a, b| {
        effective(a)
            .total_cmp(&effective(b))
            .then(b.workers.cmp(&a.workers))
    })?;
    let top = effective(best);
    let chosen = trials
        .iter()
        .filter(|t| effective(t) >= (1.0 - TOLERANCE) * top)
        .min_by_key(|t| t.workers)?;
    let why = if bound.is_some_and(|d| best.samples_per_sec > d && chosen.samples_per_sec >= d) {
        Choice::ConsumerBound
    } else if chosen.workers == best.workers {
        Choice::Fastest
    } else {
        Choice::FewestWithinTolerance
    };
    Some((chosen.workers, why))
}

/// True when the last of `trials` (measured most workers first) shows the rate falling with
/// the workers: below [`TOLERANCE`] of the best and below the trial before it, both bounded by
/// the consumer's rate (`demand`) as in [`choose`]. Fewer workers are then not measured: they
/// cannot come within the tolerance unless the rate rises again as workers go, which a rate
/// that already fell does not.
pub(crate) fn past_the_knee(trials: &[Trial], demand: Option<f64>) -> bool {
    let bound = demand.filter(|d| d.is_finite() && *d > 0.0);
    let effective = |t: &Trial| match bound {
        Some(d) => t.samples_per_sec.min(d),
        None => t.samples_per_sec,
    };
    let [.., before, last] = trials else {
        return false;
    };
    let best = trials.iter().map(effective).fold(f64::MIN, f64::max);
    effective(last) < (1.0 - TOLERANCE) * best && effective(last) < effective(before)
}

/// The candidate counts for a budget of `cpus` workers: 1, 2, 4, ... below it, the budget, and
/// `default` if within it; most first.
pub(crate) fn candidates(cpus: usize, default: usize) -> Vec<usize> {
    let mut c: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
        .take_while(|&n| n < cpus)
        .chain([cpus.max(1)])
        .chain((default <= cpus).then_some(default))
        .collect();
    c.sort_unstable_by(|a, b| b.cmp(a));
    c.dedup();
    c
}

/// What the loader chose, and why (`LoaderStats::tuning`).
#[derive(Clone, Debug, Serialize)]
pub struct Tuning {
    /// False while the workers are being measured.
    pub chosen: bool,
    /// The workers taking tasks (the choice, once made).
    pub workers: usize,
    /// Why that many, once chosen (`None` when the workers were given, not chosen).
    pub choice: Option<Choice>,
    /// The batches in flight.
    pub prefetch: usize,
    /// The parts each batch is made in.
    pub batch_parts: usize,
    /// The CPUs the workers could use.
    pub cpus: CpuBudget,
    /// The pool's byte budget (pinned or host memory): the batches in flight are within it.
    pub memory_budget: u64,
    /// Each candidate count measured, in the order tried.
    pub trials: Vec<Trial>,
    /// The consumer's rate over the measurement (samples per second of the time it did not
    /// wait), if measured.
    pub consumer_samples_per_sec: Option<f64>,
    /// Seconds the choice took.
    pub seconds: f64,
    /// What was chosen and why, in words.
    pub reason: String,
}

impl std::fmt::Display for Tuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Which worker threads may take tasks: the first `active`. The others wait here, and once the
/// count is final, stop.
#[derive(Debug)]
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug)]
struct GateState {
    active: usize,
    /// The count is the choice: workers beyond it stop.
    last: bool,
    closed: bool,
}

impl Gate {
    pub(crate) fn new(active: usize) -> Gate {
        Gate {
            state: Mutex::new(GateState {
                active,
                last: false,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until worker `index` may take a task; false when it is to stop instead.
    pub(crate) fn wait_turn(&self, index: usize) -> bool {
        let mut s = self.lock();
        loop {
            if s.closed || (s.last && index >= s.active) {
                return false;
            }
            if index < s.active {
                return true;
            }
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Lets the first `active` workers take tasks; with `last`, the others stop.
    pub(crate) fn set(&self, active: usize, last: bool) {
        let mut s = self.lock();
        s.active = active.max(1);
        s.last = last;
        drop(s);
        self.changed.notify_all();
    }

    /// Stops every waiting worker (the loader is dropped).
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }
}

/// What the loader's consumer did so far: samples delivered, time since its first call, time
/// waited (for the consumer's rate).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ConsumerClock {
    pub samples: u64,
    pub elapsed: Duration,
    pub waited: Duration,
}

/// The fixed inputs of the settings derived from the workers.
#[derive(Clone, Debug)]
pub(crate) struct Derive {
    /// Bytes of one batch buffer.
    pub batch_bytes: u64,
    /// Samples a batch holds at most.
    pub capacity: usize,
    /// Batches in an epoch.
    pub batches: u64,
    /// Batches the pool's budget holds.
    pub budget_batches: usize,
    /// The user's prefetch and parts, where given.
    pub prefetch: Option<usize>,
    pub parts: Option<usize>,
}

impl Derive {
    /// The parts for `workers` workers: the given ones, else the default rule's.
    pub(crate) fn parts(&self, workers: usize) -> usize {
        self.parts
            .unwrap_or_else(|| default_parts(workers, self.batch_bytes))
            .clamp(1, self.capacity.max(1))
    }

    /// The batches in flight for `workers` workers: the given number, else the default rule's,
    /// kept within the budget (two batches of it left for the caller to hold).
    pub(crate) fn prefetch(&self, workers: usize) -> usize {
        self.prefetch.unwrap_or_else(|| {
            default_prefetch(workers, self.batch_bytes, self.parts(workers), self.batches)
                .min(self.budget_batches.saturating_sub(2).max(1))
        })
    }
}

/// Where the measurement stands.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Waiting, since `since`, for the tasks begun under the previous count to end (as many
    /// batches or parts as it had workers, counted from `from`).
    Settling {
        since: Instant,
        from: Work,
    },
    /// Measuring since `since`, from the work counted then.
    Measuring {
        since: Instant,
        from: Work,
    },
    Done,
}

/// The workers' counted work: batches or parts written, samples, and time writing them.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Work {
    pub fills: u64,
    pub samples: u64,
    pub busy_ns: u64,
}

/// The measurement and its outcome.
pub(crate) struct Tuner {
    gate: Arc<Gate>,
    derive: Derive,
    candidates: Vec<usize>,
    /// The candidate being measured (an index into `candidates`).
    at: usize,
    phase: Phase,
    trials: Vec<Trial>,
    started: Instant,
    consumer_from: Option<ConsumerClock>,
    consumer_rate: Option<f64>,
    cpus: CpuBudget,
    memory_budget: u64,
    /// The workers were given, not chosen.
    fixed: bool,
    outcome: Option<(usize, Option<Choice>)>,
    finished: Option<Instant>,
}

impl Tuner {
    /// A measurement over `candidates` (most first), the first of which is active now; with
    /// one candidate, nothing is measured (the workers were given).
    pub(crate) fn new(
        now: Instant,
        gate: Arc<Gate>,
        derive: Derive,
        candidates: Vec<usize>,
        cpus: CpuBudget,
        memory_budget: u64,
        fixed: bool,
    ) -> Tuner {
        let mut tuner = Tuner {
            gate,
            derive,
            candidates,
            at: 0,
            phase: Phase::Settling {
                since: now,
                from: Work::default(),
            },
            trials: Vec::new(),
            started: now,
            consumer_from: None,
            consumer_rate: None,
            cpus,
            memory_budget,
            fixed,
            outcome: None,
            finished: None,
        };
        if tuner.candidates.len() <= 1 {
            let workers = tuner.candidates.first().copied().unwrap_or(1);
            tuner.finish(workers, None);
        }
        tuner
    }

    /// The gate of the workers.
    pub(crate) fn gate(&self) -> Arc<Gate> {
        Arc::clone(&self.gate)
    }

    /// The workers taking tasks now.
    pub(crate) fn active(&self) -> usize {
        match self.outcome {
            Some((w, _)) => w,
            None => self.candidates.get(self.at).copied().unwrap_or(1),
        }
    }

    /// The choice, once made: (workers, prefetch, parts).
    pub(crate) fn chosen(&self) -> Option<(usize, usize, usize)> {
        let (w, _) = self.outcome?;
        Some((w, self.derive.prefetch(w), self.derive.parts(w)))
    }

    /// Moves the measurement on at `now`, given the workers' counters so far (`work`, from
    /// the loader's stage times) and the consumer's; returns the settings to use from now
    /// (workers, prefetch, parts) when the choice was just made.
    pub(crate) fn step(
        &mut self,
        now: Instant,
        work: Work,
        consumer: ConsumerClock,
    ) -> Option<(usize, usize, usize)> {
        if self.outcome.is_some() {
            return None;
        }
        let consumer_from = *self.consumer_from.get_or_insert(consumer);
        let active = self.active();
        match self.phase {
            Phase::Settling { since, from } => {
                // Settled once as many tasks as were running under the previous count ended.
                let running = if self.at == 0 {
                    active
                } else {
                    self.candidates[self.at - 1]
                };
                if work.fills >= from.fills + running as u64 || now - since >= TRIAL_LIMIT / 2 {
                    self.phase = Phase::Measuring {
                        since: now,
                        from: work,
                    };
                }
            }
            Phase::Measuring { since, from } => {
                let fills = work.fills - from.fills;
                let took = now - since;
                let enough = fills >= TRIAL_FILLS_PER_WORKER * active as u64 && took >= TRIAL_MIN;
                if enough || took >= TRIAL_LIMIT / 2 {
                    let busy = (work.busy_ns - from.busy_ns) as f64 / 1e9;
                    if fills > 0 && busy > 0.0 {
                        self.trials.push(Trial {
                            workers: active,
                            samples_per_sec: active as f64 * (work.samples - from.samples) as f64
                                / busy,
                            fills,
                            seconds: took.as_secs_f64(),
                        });
                    }
                    self.at += 1;
                    // No trial starts that could end after the limit, nor one that cannot
                    // change the choice.
                    let out_of_time = now - self.started + TRIAL_LIMIT > TUNE_LIMIT;
                    let falling =
                        past_the_knee(&self.trials, consumer_rate(consumer_from, consumer));
                    match self.candidates.get(self.at) {
                        Some(&next) if !out_of_time && !falling => {
                            self.gate.set(next, false);
                            self.phase = Phase::Settling {
                                since: now,
                                from: work,
                            };
                        }
                        _ => {
                            self.consumer_rate = consumer_rate(consumer_from, consumer);
                            let fallback = self.candidates.first().copied().unwrap_or(1);
                            let (w, why) = match choose(&self.trials, self.consumer_rate) {
                                Some((w, why)) => (w, Some(why)),
                                None => (fallback, None),
                            };
                            self.finish(w, why);
                            return self.chosen();
                        }
                    }
                }
            }
            Phase::Done => {}
        }
        None
    }

    fn finish(&mut self, workers: usize, why: Option<Choice>) {
        self.gate.set(workers, true);
        self.outcome = Some((workers, why));
        self.phase = Phase::Done;
        self.finished = Some(Instant::now());
    }

    /// What was chosen and why (or what is being measured).
    pub(crate) fn report(&self) -> Tuning {
        let workers = self.active();
        let (prefetch, parts) = (self.derive.prefetch(workers), self.derive.parts(workers));
        let choice = self.outcome.and_then(|(_, why)| why);
        let seconds = self
            .finished
            .unwrap_or_else(Instant::now)
            .duration_since(self.started)
            .as_secs_f64();
        let mut reason = match (self.outcome, self.fixed) {
            (None, _) => format!(
                "autotune: measuring {} of {} (candidates {:?})",
                count(workers, "worker", "workers"),
                self.cpus.budget,
                self.candidates
            ),
            (Some(_), true) => {
                format!("autotune: {} as given", count(workers, "worker", "workers"))
            }
            (Some(_), false) => {
                let trials: Vec<String> = self
                    .trials
                    .iter()
                    .map(|t| format!("{}: {:.0}", t.workers, t.samples_per_sec))
                    .collect();
                let why = match choice {
                    Some(Choice::Fastest) => "the fastest".to_owned(),
                    Some(Choice::FewestWithinTolerance) => {
                        format!("the fewest within {:.0}% of the fastest", TOLERANCE * 100.0)
                    }
                    Some(Choice::ConsumerBound) => format!(
                        "the fewest that keep up with the consumer ({:.0} samples/s)",
                        self.consumer_rate.unwrap_or(0.0)
                    ),
                    None => "nothing measured: the most the budget holds".to_owned(),
                };
                format!(
                    "autotune: {} of a budget of {} ({}); samples/s by workers {}: {why}",
                    count(workers, "worker", "workers"),
                    count(self.cpus.budget, "CPU", "CPUs"),
                    self.cpus,
                    trials.join(", "),
                )
            }
        };
        let derived = |given: Option<usize>| if given.is_some() { "given" } else { "derived" };
        reason.push_str(&format!(
            "; prefetch {prefetch} ({}), {} ({}), within a memory budget of {}",
            derived(self.derive.prefetch),
            count(parts, "part", "parts"),
            derived(self.derive.parts),
            human_bytes(self.memory_budget)
        ));
        Tuning {
            chosen: self.outcome.is_some(),
            workers,
            choice,
            prefetch,
            batch_parts: parts,
            cpus: self.cpus.clone(),
            memory_budget: self.memory_budget,
            trials: self.trials.clone(),
            consumer_samples_per_sec: self.consumer_rate,
            seconds,
            reason,
        }
    }
}

/// The consumer's samples per second of the time it did not wait, between two clocks.
fn consumer_rate(from: ConsumerClock, to: ConsumerClock) -> Option<f64> {
    let samples = to.samples.checked_sub(from.samples)?;
    let busy = (to.elapsed.saturating_sub(from.elapsed))
        .saturating_sub(to.waited.saturating_sub(from.waited))
        .as_secs_f64();
    (samples > 0 && busy > 1e-3).then(|| samples as f64 / busy)
}

fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

#[cfg(test)]
mod tests {
    use super::{Choice, Trial, candidates, choose, past_the_knee};

    fn trials(rates: &[(usize, f64)]) -> Vec<Trial> {
        rates
            .iter()
            .map(|&(workers, samples_per_sec)| Trial {
                workers,
                samples_per_sec,
                fills: 8,
                seconds: 0.1,
            })
            .collect()
    }

    #[test]
    fn rates_that_grow_with_the_workers_choose_the_most() {
        let t = trials(&[
            (16, 16_000.0),
            (8, 8_100.0),
            (4, 4_000.0),
            (2, 2_000.0),
            (1, 1_000.0),
        ]);
        assert_eq!(choose(&t, None), Some((16, Choice::Fastest)));
    }

    #[test]
    fn a_flat_curve_chooses_the_fewest_workers_within_the_tolerance() {
        // Memory bandwidth saturated from 4 workers on: 4 is within 3% of the fastest (8).
        let t = trials(&[
            (16, 40.0e3),
            (8, 41.0e3),
            (4, 40.2e3),
            (2, 30.0e3),
            (1, 16.0e3),
        ]);
        assert_eq!(choose(&t, None), Some((4, Choice::FewestWithinTolerance)));
        // 2.9% below the best counts, 3.1% does not.
        let t = trials(&[(2, 100.0), (1, 97.1)]);
        assert_eq!(choose(&t, None), Some((1, Choice::FewestWithinTolerance)));
        let t = trials(&[(2, 100.0), (1, 96.9)]);
        assert_eq!(choose(&t, None), Some((2, Choice::Fastest)));
    }

    #[test]
    fn a_slow_consumer_gets_the_fewest_workers_that_keep_up_with_it() {
        let t = trials(&[(8, 8_000.0), (4, 4_000.0), (2, 2_000.0), (1, 1_000.0)]);
        assert_eq!(choose(&t, Some(1_900.0)), Some((2, Choice::ConsumerBound)));
        // A consumer faster than every count: the rates alone decide.
        assert_eq!(choose(&t, Some(1e9)), Some((8, Choice::Fastest)));
        // An unknown consumer rate (none, zero, not finite) bounds nothing.
        for d in [None, Some(0.0), Some(f64::NAN), Some(f64::INFINITY)] {
            assert_eq!(choose(&t, d), Some((8, Choice::Fastest)), "{d:?}");
        }
    }

    #[test]
    fn the_choice_is_the_same_whatever_the_order_of_the_trials() {
        let mut t = trials(&[(1, 5.0), (2, 9.9), (4, 10.0), (8, 9.0)]);
        let first = choose(&t, None);
        assert_eq!(first, Some((2, Choice::FewestWithinTolerance)));
        t.reverse();
        assert_eq!(choose(&t, None), first);
        t.swap(0, 2);
        assert_eq!(choose(&t, None), first);
        // Equal rates: the fewer workers.
        assert_eq!(
            choose(&trials(&[(4, 7.0), (2, 7.0)]), None),
            Some((2, Choice::Fastest))
        );
        assert_eq!(choose(&[], None), None);
    }

    /// Runs a tuner over simulated workers (each active worker writes a batch every 10 ms, all
    /// together `rate(workers)` samples a second, busy all the time) and a consumer that takes
    /// `demand` samples a second (`None`: as fast as they come, always waiting); returns the
    /// tuner and the simulated seconds it took to choose.
    fn simulate(
        budget: usize,
        rate: impl Fn(usize) -> f64,
        demand: Option<f64>,
    ) -> (super::Tuner, f64) {
        use super::{ConsumerClock, Derive, Gate, Tuner};
        use crate::loader::CpuBudget;
        use crate::loader::stats::StageTimes;
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        let derive = Derive {
            batch_bytes: 1 << 20,
            capacity: 256,
            batches: 1000,
            budget_batches: 20,
            prefetch: None,
            parts: None,
        };
        let counts = candidates(budget, budget);
        let start = Instant::now();
        let gate = Arc::new(Gate::new(counts[0]));
        let cpus = CpuBudget::from_parts(budget, None, false);
        let mut tuner = Tuner::new(start, gate, derive, counts, cpus, 1 << 30, false);
        let times = StageTimes::default();
        let dt = Duration::from_millis(10);
        let (mut t, mut made) = (Duration::ZERO, 0.0f64);
        while tuner.chosen().is_none() {
            assert!(t < Duration::from_secs(60), "no choice after {t:?}");
            t += dt;
            let w = tuner.active();
            let samples = rate(w) * dt.as_secs_f64();
            made += samples;
            if samples > 0.0 {
                let busy = w as u64 * dt.as_nanos() as u64;
                for _ in 0..w {
                    times.add_fetch_transform((samples / w as f64) as usize, busy / w as u64, 0);
                }
            }
            let consumer = match demand {
                None => ConsumerClock {
                    samples: made as u64,
                    elapsed: t,
                    waited: t,
                },
                Some(d) => ConsumerClock {
                    samples: (d * t.as_secs_f64()) as u64,
                    elapsed: t,
                    waited: Duration::ZERO,
                },
            };
            tuner.step(start + t, times.work(), consumer);
        }
        (tuner, t.as_secs_f64())
    }

    #[test]
    fn the_tuner_measures_each_count_and_chooses_from_the_rates_within_its_time_limit() {
        let rates = |w: usize| match w {
            1 => 10_000.0,
            2 => 19_000.0,
            4 => 30_000.0,
            _ => 30_500.0,
        };
        let (tuner, took) = simulate(8, rates, None);
        let report = tuner.report();
        let measured: Vec<usize> = report.trials.iter().map(|t| t.workers).collect();
        // 2 workers fell below 4's rate and the tolerance: 1 is not measured.
        assert_eq!(measured, [8, 4, 2]);
        for t in &report.trials {
            let expected = rates(t.workers);
            assert!(
                (t.samples_per_sec - expected).abs() < 0.02 * expected,
                "{t:?}"
            );
        }
        // 4 workers make 98.4% of what 8 make.
        assert_eq!(tuner.chosen().map(|c| c.0), Some(4));
        assert_eq!(report.choice, Some(Choice::FewestWithinTolerance));
        assert!(took <= super::TUNE_LIMIT.as_secs_f64(), "{took} s");
        // The workers beyond the choice stop; the others go on.
        let gate = tuner.gate();
        assert!(!gate.wait_turn(4) && !gate.wait_turn(7) && gate.wait_turn(3));
    }

    #[test]
    fn going_down_stops_once_the_rate_falls_with_the_workers() {
        let t = |rates: &[(usize, f64)]| trials(rates);
        // Falling below the tolerance and below the count before: stop.
        assert!(past_the_knee(&t(&[(16, 14.3e6), (8, 7.9e6)]), None));
        // Within the tolerance of the best: go on (fewer may do as well).
        assert!(!past_the_knee(&t(&[(16, 100.0), (8, 98.0)]), None));
        // Below the best but rising from the count before (too many threads for the CPUs
        // at 4, 8 and 16): go on.
        assert!(!past_the_knee(
            &t(&[(16, 100.0), (8, 60.0), (4, 70.0)]),
            None
        ));
        assert!(past_the_knee(
            &t(&[(16, 100.0), (8, 60.0), (4, 70.0), (2, 50.0)]),
            None
        ));
        // One trial, or none: nothing to compare.
        assert!(!past_the_knee(&t(&[(16, 1.0)]), None));
        assert!(!past_the_knee(&[], None));
        // A consumer slower than both counts: equal rates, go on to find the fewest.
        assert!(!past_the_knee(&t(&[(8, 8e3), (4, 4e3)]), Some(2e3)));
        assert!(past_the_knee(
            &t(&[(8, 8e3), (4, 4e3), (2, 2e3), (1, 1e3)]),
            Some(2e3)
        ));

        // Rates that double with the workers: only the two most are measured, 16 is chosen.
        let (tuner, linear) = simulate(16, |w| 1e6 * w as f64, None);
        let measured: Vec<usize> = tuner.report().trials.iter().map(|t| t.workers).collect();
        assert_eq!(measured, [16, 8]);
        assert_eq!(tuner.chosen().map(|c| c.0), Some(16));
        // Two CPUs, one worker faster than two: both measured, one chosen.
        let (tuner, _) = simulate(2, |w| if w == 1 { 25e3 } else { 19e3 }, None);
        let measured: Vec<usize> = tuner.report().trials.iter().map(|t| t.workers).collect();
        assert_eq!(measured, [2, 1]);
        assert_eq!(tuner.chosen().map(|c| c.0), Some(1));
        assert!(linear < 1.0, "{linear} s");
    }

    #[test]
    fn a_slow_consumer_is_served_by_the_fewest_workers_that_keep_up() {
        let (tuner, _) = simulate(4, |w| 1000.0 * w as f64, Some(1500.0));
        assert_eq!(tuner.chosen().map(|c| c.0), Some(2));
        assert_eq!(tuner.report().choice, Some(Choice::ConsumerBound));
    }

    #[test]
    fn workers_that_make_nothing_measurable_still_get_a_choice_within_the_time_limit() {
        // Every batch takes longer than a trial: nothing is measured, the budget's count stays.
        let (tuner, took) = simulate(16, |_| 0.0, None);
        assert_eq!(tuner.chosen().map(|c| c.0), Some(16));
        assert_eq!(tuner.report().choice, None);
        assert!(tuner.report().trials.is_empty());
        assert!(took <= super::TUNE_LIMIT.as_secs_f64(), "{took} s");
    }

    #[test]
    fn candidates_are_powers_of_two_below_the_budget_the_budget_and_the_default() {
        assert_eq!(candidates(1, 1), [1]);
        assert_eq!(candidates(2, 2), [2, 1]);
        assert_eq!(candidates(16, 14), [16, 14, 8, 4, 2, 1]);
        assert_eq!(candidates(6, 16), [6, 4, 2, 1]);
        assert_eq!(candidates(0, 1), [1]);
    }
}
