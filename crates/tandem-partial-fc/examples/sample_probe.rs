//! How long PartialFC's class sampling takes per step on the host at arcface_torch's scale:
//! `UniformNegatives` (a uniform draw per centre, then a linear-time selection of the largest)
//! against the full sort of every draw it replaced, on the same draw, and `DrawAhead` (the same
//! index, drawn a step ahead on a background thread): the time left on the step's own thread
//! when 30 ms of training separate the steps. Best of 10 (ms).
//! `cargo run --release -p tandem-partial-fc --example sample_probe [CENTRES [RATE]]`
use std::time::Instant;

use rand::{Rng, SeedableRng};
use tandem_partial_fc::{SampleRequest, Sampler};

fn best_ms(mut f: impl FnMut()) -> f64 {
    (0..10)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let num_local: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let rate: f64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(0.1);
    let num_sample = (rate * num_local as f64) as usize;
    let positives: Vec<usize> = (0..128).map(|i| i * (num_local / 128)).collect();
    let req = SampleRequest { rank: 0, step: 1, num_local, num_sample, positives: &positives };
    let mut sampler = tandem_partial_fc::UniformNegatives { seed: 7 };
    let selection = best_ms(|| drop(sampler.sample(&req)));
    // The earlier way: the same draw, every centre sorted.
    let sorting = best_ms(|| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut draw: Vec<(f32, usize)> =
            (0..num_local).map(|c| (rng.random::<f32>(), c)).collect();
        for &p in &positives {
            draw[p].0 = 2.0;
        }
        draw.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut index: Vec<usize> = draw.into_iter().take(num_sample).map(|(_, c)| c).collect();
        index.sort_unstable();
    });
    let mut ahead = tandem_partial_fc::DrawAhead::new(7);
    let mut step = 0;
    let on_the_steps_thread = best_ms(|| {
        // The step before this one trains while the draw is made.
        std::thread::sleep(std::time::Duration::from_millis(30));
        step += 1;
        drop(ahead.sample(&SampleRequest { step, ..req }));
    }) - 30.0;
    println!(
        "class sampling, {num_local} centres at rate {rate} ({num_sample} kept): selection {selection:.1} ms, full sort {sorting:.1} ms ({:.1}x); drawn ahead: {on_the_steps_thread:.1} ms on the step's thread ({:.1}x less than the selection)",
        sorting / selection,
        selection / on_the_steps_thread
    );
}
