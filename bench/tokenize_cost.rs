//! The tokenizer's own cost for one piece of text: `tokenize_cost DIR TEXT` tokenizes TEXT alone
//! with the HuggingFace tokenizer in DIR (as kvepp loads it) and prints the median µs of 201 runs.
//! bench/cpu_per_request.py compares tokens mode's extra CPU per request with it.

use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(text)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: tokenize_cost DIR TEXT");
    };
    let t = kvepp::request::tokenize::ModelTokenizer::load(std::path::Path::new(&dir))?;
    let mut times = Vec::with_capacity(201);
    let mut n = 0;
    for _ in 0..201 {
        let start = Instant::now();
        n = t.text_ids_whole(&text)?.len();
        times.push(start.elapsed());
    }
    times.sort();
    println!("{:.2} µs for {n} tokens", times[100].as_secs_f64() * 1e6);
    Ok(())
}
