//! The core engine on the real model: cache correctness, tokenizer, chat prompt, greedy output.

use crate::common::{chat_ids, engine, full, greedy, rel_diff};
use kvchat::kv::CacheSpec;
use kvchat::model::Logits;
use kvchat::session::{Sampler, SamplingParams};

#[test]
fn greedy_output_with_full_cache_equals_no_cache_for_48_tokens_on_two_prompts() {
    for prompt in [
        chat_ids("What is the capital of France?"),
        engine().raw_prompt("def fibonacci(n):").unwrap(),
    ] {
        let (a, la) = greedy(&full(), &prompt, 48);
        let (b, lb) = greedy(&CacheSpec::none(kvchat::kv::Precision::F32), &prompt, 48);
        assert_eq!(a, b, "full and no-cache greedy tokens differ");
        let d = rel_diff(&la, &lb);
        assert!(d < 1e-4, "last-step logits differ by {d} relative");
    }
}

#[test]
fn one_prefill_equals_prefix_prefill_then_token_by_token_decode() {
    let e = engine();
    let prompt = chat_ids("Explain what a KV cache is, in two sentences.");
    let mut whole = e.session(&full());
    let a: Vec<f32> = whole.feed(&prompt).unwrap().to_vec1().unwrap();

    let split = prompt.len() - 9;
    let mut parts = e.session(&full());
    let mut logits = parts.feed(&prompt[..split]).unwrap();
    for &t in &prompt[split..] {
        logits = parts.feed(&[t]).unwrap();
    }
    let b: Vec<f32> = logits.to_vec1().unwrap();
    let d = rel_diff(&b, &a);
    assert!(d < 1e-4, "next-token logits differ by {d} relative");
}

#[test]
fn all_position_logits_match_step_by_step_logits() {
    // The causal mask: position i of a prefill must see exactly what a decode at i sees.
    let e = engine();
    let prompt = e
        .raw_prompt("The quick brown fox jumps over the lazy dog")
        .unwrap();
    let mut whole = e.session(&full());
    let all = whole.feed_with(&prompt, Logits::All).unwrap();
    let mut steps = e.session(&full());
    for (i, &t) in prompt.iter().enumerate() {
        let step: Vec<f32> = steps.feed(&[t]).unwrap().to_vec1().unwrap();
        let row: Vec<f32> = all.get(i).unwrap().to_vec1().unwrap();
        let d = rel_diff(&row, &step);
        assert!(d < 1e-4, "position {i}: logits differ by {d} relative");
    }
}

#[test]
fn prefill_longer_than_one_chunk_equals_token_by_token() {
    // Prompts longer than the prefill chunk (512) are prefilled in pieces; the result must not change.
    let e = engine();
    let text = "kv cache ".repeat(300);
    let prompt = e.raw_prompt(&text).unwrap();
    assert!(prompt.len() > 600, "{} tokens", prompt.len());
    let mut chunked = e.session(&full());
    let a: Vec<f32> = chunked.feed(&prompt).unwrap().to_vec1().unwrap();
    let mut two = e.session(&full());
    two.feed(&prompt[..prompt.len() - 1]).unwrap();
    let b: Vec<f32> = two
        .feed(&prompt[prompt.len() - 1..])
        .unwrap()
        .to_vec1()
        .unwrap();
    let d = rel_diff(&a, &b);
    assert!(d < 1e-4, "logits differ by {d} relative");
}

#[test]
fn tokenizer_encodes_hello_world_as_reference_ids() {
    assert_eq!(
        engine().tokenizer().encode("Hello, world!").unwrap(),
        vec![19556, 28, 905, 17]
    );
}

#[test]
fn tokenizer_round_trips_mixed_text() {
    let tk = &engine().tokenizer();
    for text in [
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "東京は日本の首都です。中文也可以。",
        "emoji: 🦀🚀👩‍💻 and accents: café naïve",
        "  leading, trailing  \t tabs\n\n\nand runs of     spaces   ",
        "numbers 1234567890 and 3.14159",
    ] {
        let ids = tk.encode(text).unwrap();
        assert_eq!(tk.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn tokenizer_splits_digits_one_by_one_as_smollm_does() {
    let tk = &engine().tokenizer();
    let ids = tk.encode("2024").unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
}

#[test]
fn chat_prompt_uses_the_models_template_and_specials() {
    let ids = chat_ids("What is the capital of France?");
    assert_eq!(ids.len(), 37, "{ids:?}");
    assert_eq!(&ids[..4], &[1, 9690, 198, 2683]);
    let text = engine().tokenizer().decode(&ids, false).unwrap();
    assert!(
        text.ends_with("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
        "{text:?}"
    );
}

#[test]
fn end_of_turn_token_stops_generation() {
    let e = engine();
    let im_end = e.tokenizer().token_id("<|im_end|>").unwrap();
    assert!(e.stop_ids().contains(&im_end), "{:?}", e.stop_ids());
    assert!(e.stop_ids().contains(&2), "EOS missing: {:?}", e.stop_ids());
}

#[test]
fn raw_greedy_completion_of_capital_of_france_begins_paris() {
    let e = engine();
    let prompt = e.raw_prompt("The capital of France is").unwrap();
    let (out, _) = greedy(&full(), &prompt, 8);
    let text = e.tokenizer().decode(&out, true).unwrap();
    assert!(text.starts_with(" Paris."), "got {text:?}");
}

#[test]
fn full_cache_reports_its_bytes_exactly() {
    let e = engine();
    let cfg = &e.model().cfg;
    let mut s = e.session(&full());
    let prompt = e.raw_prompt("Counting the bytes of a cache").unwrap();
    s.feed(&prompt).unwrap();
    let per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4;
    assert_eq!(per_token, 46_080); // 2 × 30 layers × 3 KV heads × 64 × 4 bytes
    assert_eq!(s.cache().len(), prompt.len());
    assert_eq!(s.cache().bytes_used(), prompt.len() * per_token);
    // Lazily allocated: the first block is 256 positions, not the whole context.
    assert_eq!(s.cache().bytes(), 256 * per_token);
}

#[test]
fn no_cache_holds_nothing_between_steps() {
    let e = engine();
    let mut s = e.session(&CacheSpec::none(kvchat::kv::Precision::F32));
    s.feed(&e.raw_prompt("nothing kept").unwrap()).unwrap();
    assert_eq!(s.cache().len(), 0);
    assert_eq!(s.cache().bytes(), 0);
}

#[test]
fn sampling_with_a_seed_is_reproducible_and_differs_from_greedy_sometimes() {
    let e = engine();
    let prompt = chat_ids("Write a short poem about the sea.");
    let run = |seed| {
        let mut s = e.session(&full());
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        });
        s.generate(&prompt, &mut sampler, 24, &[], true, |_| Ok(true))
            .unwrap()
            .0
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn tokenizer_json_override_gives_the_same_ids_as_the_gguf_tokenizer() {
    let e = engine();
    let path = std::env::temp_dir().join(format!("kvchat-tokenizer-{}.json", std::process::id()));
    e.tokenizer().to_hf().unwrap().save(&path, false).unwrap();
    let tk = kvchat::tokenizer::Tokenizer::from_file(&path, Some(e.tokenizer())).unwrap();
    for text in [
        "Hello, world!",
        "<|im_start|>user\nhi 123<|im_end|>",
        "東京 🦀  x",
    ] {
        assert_eq!(
            tk.encode(text).unwrap(),
            e.tokenizer().encode(text).unwrap(),
            "{text:?}"
        );
    }
    assert_eq!(tk.eos_id, e.tokenizer().eos_id);
}

#[test]
fn a_batched_decode_step_gives_each_session_the_logits_it_gets_alone_bit_for_bit() {
    // Four sequences of different lengths, each in a cache of other axes, decoded together one
    // step at a time (one pass over the weights for all four), against each decoded alone.
    let e = engine();
    let doc = &include_str!("../../assets/gpl-3.txt")[..1500];
    let prompts = [
        chat_ids("Name three colours."),
        chat_ids(&format!("Summarise this text in one sentence:\n\n{doc}")),
        chat_ids("Count from one to twenty in words."),
        chat_ids(&format!("What is this text about?\n\n{}", &doc[..600])),
    ];
    let modes = ["full", "full+int8", "window:48+4", "budget:128:snapkv+4"];
    let specs: Vec<CacheSpec> = modes
        .iter()
        .map(|m| {
            m.parse::<kvchat::kv::CacheMode>()
                .unwrap()
                .spec(4096)
                .unwrap()
        })
        .collect();
    let steps = 40;
    let argmax = |l: &candle_core::Tensor| kvchat::session::argmax(&l.to_vec1::<f32>().unwrap());
    let bits = |l: &candle_core::Tensor| -> Vec<u32> {
        l.to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    // Alone: each session's logits at every step.
    let alone: Vec<Vec<Vec<u32>>> = prompts
        .iter()
        .zip(&specs)
        .map(|(p, spec)| {
            let mut s = e.session(spec);
            let mut l = s.feed(p).unwrap();
            (0..steps)
                .map(|_| {
                    l = s.feed(&[argmax(&l)]).unwrap();
                    bits(&l)
                })
                .collect()
        })
        .collect();
    // Together.
    let mut sessions: Vec<_> = specs.iter().map(|spec| e.session(spec)).collect();
    let mut logits: Vec<_> = sessions
        .iter_mut()
        .zip(&prompts)
        .map(|(s, p)| s.feed(p).unwrap())
        .collect();
    for step in 0..steps {
        let next: Vec<u32> = logits.iter().map(argmax).collect();
        let mut refs: Vec<&mut kvchat::session::Session> = sessions.iter_mut().collect();
        logits = kvchat::session::Session::feed_each(&mut refs, &next).unwrap();
        for ((l, own), mode) in logits.iter().zip(&alone).zip(modes) {
            assert!(bits(l) == own[step], "{mode}: step {step}");
        }
    }
    // The window dropped positions and the budget evicted while batched.
    assert!(sessions[2].cache().len() < sessions[2].tokens().len());
    assert!(sessions[3].cache().layers()[0].evicted().unwrap() > 0);
}

#[test]
fn a_batched_step_with_a_token_missing_or_a_session_without_a_cache_is_refused() {
    let e = engine();
    let spec = full();
    let none = "none"
        .parse::<kvchat::kv::CacheMode>()
        .unwrap()
        .spec(4096)
        .unwrap();
    let (mut a, mut b) = (e.session(&spec), e.session(&none));
    a.feed(&chat_ids("Hi")).unwrap();
    b.feed(&chat_ids("Hi")).unwrap();
    let before = a.tokens().to_vec();
    let err = kvchat::session::Session::feed_each(&mut [&mut a], &[1, 2]).unwrap_err();
    assert!(
        err.to_string().contains("one token for each session"),
        "{err}"
    );
    let err = kvchat::session::Session::feed_each(&mut [&mut a, &mut b], &[1, 2]).unwrap_err();
    assert!(
        err.to_string()
            .contains("every sequence to keep a KV cache"),
        "{err}"
    );
    // Nothing was kept of the refused step.
    assert_eq!(a.tokens(), &before[..]);
    assert_eq!(a.cache().seen(), before.len());
}

/// The batching tests' questions; the second is sampled at temperature 0.8 with a seed, the
/// others greedily (`batch_params`).
const BATCH_QUESTIONS: [&str; 4] = [
    "Name three colours.",
    "Write a haiku about the sea.",
    "Count from one to ten in words.",
    "What is the capital of Italy? Answer in one sentence.",
];

fn batch_params(i: usize) -> SamplingParams {
    match i {
        1 => SamplingParams {
            temperature: 0.8,
            seed: 11,
            ..Default::default()
        },
        _ => SamplingParams::greedy(),
    }
}

/// Question i's answer decoded alone (`Session::decode`) in a full cache, at most `limit` tokens.
fn decoded_alone(i: usize, limit: usize) -> Vec<u32> {
    let e = engine();
    let mut s = e.session(&full());
    let logits = s.feed(&chat_ids(BATCH_QUESTIONS[i])).unwrap();
    let mut sampler = Sampler::new(batch_params(i));
    let (out, ..) = s
        .decode(logits, &mut sampler, limit, e.stop_ids(), false, |_| {
            Ok(true)
        })
        .unwrap();
    out
}

/// Question i joins `batch` as sequence i, in a full cache, for at most `limit` tokens.
fn join_batch<'m>(batch: &mut kvchat::session::batch::Batch<'m>, i: usize, limit: usize) {
    let e = engine();
    let sampler = Sampler::new(batch_params(i));
    let prompt = chat_ids(BATCH_QUESTIONS[i]);
    batch
        .join(
            i as u64,
            e.session(&full()),
            &prompt,
            sampler,
            limit,
            e.stop_ids(),
        )
        .unwrap();
}

#[test]
fn sequences_joining_and_leaving_a_batch_each_generate_what_they_generate_alone() {
    // Continuous batching's loop: two sequences start, a third joins at step 5 and a fourth at
    // step 12, each stops at its own limit or end of text; one samples at temperature 0.8 with a
    // seed. Each one's tokens are those of `Session::decode` alone.
    let limits = [30, 40, 25, 35];
    let alone: Vec<Vec<u32>> = (0..4).map(|i| decoded_alone(i, limits[i])).collect();
    let mut batch = kvchat::session::batch::Batch::new();
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); 4];
    let mut finished = Vec::new();
    let joins = [0, 0, 5, 12];
    let mut step = 0;
    while finished.len() < 4 {
        for i in (0..4).filter(|&i| joins[i] == step) {
            join_batch(&mut batch, i, limits[i]);
        }
        finished.extend(batch.step(|id, t| streamed[id as usize].push(t)).unwrap());
        step += 1;
        assert!(step < 200, "the batch never emptied");
    }
    assert!(batch.is_empty());
    for f in &finished {
        let i = f.id as usize;
        assert_eq!(f.tokens, alone[i], "sequence {i}");
        assert_eq!(
            streamed[i], alone[i],
            "sequence {i}: the tokens as they came"
        );
    }
}

#[test]
fn a_sequence_preempted_and_resumed_twice_generates_what_it_generates_alone() {
    // A server's preemption: sequence 1 (sampling at temperature 0.8 with a seed) leaves the
    // batch at step 10, its rows dropped; it resumes at step 15 from its prompt alone, leaves
    // again at step 18 while its 10 tokens are still being fed again, and resumes at step 20.
    // Both sequences' tokens are those they generate alone, each told once.
    let e = engine();
    let limit = 40;
    let alone: Vec<Vec<u32>> = (0..2).map(|i| decoded_alone(i, limit)).collect();
    assert!(alone[1].len() > 20, "{:?}", alone[1]);
    let mut batch = kvchat::session::batch::Batch::new();
    for i in 0..2 {
        join_batch(&mut batch, i, limit);
    }
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); 2];
    let mut finished = Vec::new();
    let mut paused = None;
    let mut step = 0;
    while finished.len() < 2 {
        match step {
            10 | 18 => {
                let p = batch.preempt(1).unwrap();
                assert_eq!(p.tokens(), &alone[1][..10]);
                paused = Some(p);
            }
            15 | 20 => {
                let prompt = chat_ids(BATCH_QUESTIONS[1]);
                let p = paused.take().unwrap();
                batch.resume(1, e.session(&full()), &prompt, p).unwrap();
            }
            _ => {}
        }
        finished.extend(batch.step(|id, t| streamed[id as usize].push(t)).unwrap());
        step += 1;
        assert!(step < 200, "the batch never emptied");
    }
    for f in &finished {
        let i = f.id as usize;
        assert_eq!(f.tokens, alone[i], "sequence {i}");
        assert_eq!(streamed[i], alone[i], "sequence {i}: the tokens as told");
    }
}

/// Two prompts that share their first ~650 tokens and then part.
fn two_prompts_sharing_a_start() -> (Vec<u32>, Vec<u32>) {
    let e = engine();
    let start = kvchat::eval::bench::BENCH_TEXT[..3000].to_string();
    let a = e
        .raw_prompt(&format!("{start} Question: what is this text about?"))
        .unwrap();
    let b = e
        .raw_prompt(&format!("{start} Summarise it in one line, please."))
        .unwrap();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(common > 2 * kvchat::kv::SHARED_BLOCK, "{common}");
    (a, b)
}

fn logits(s: &mut kvchat::session::Session<'_>, ids: &[u32]) -> Vec<f32> {
    s.feed(ids).unwrap().to_vec1().unwrap()
}

/// Two prompts sharing a start, a session that prefilled the first (the maker), and the blocks of
/// it that the second starts with, made from the maker's rows.
struct SharedStart {
    a: Vec<u32>,
    b: Vec<u32>,
    maker: kvchat::session::Session<'static>,
    blocks: Vec<std::sync::Arc<kvchat::kv::SharedBlock>>,
}

fn shared_start() -> SharedStart {
    let (a, b) = two_prompts_sharing_a_start();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let maker = prefilled(&a);
    let blocks = maker
        .share_blocks(0, common / kvchat::kv::SHARED_BLOCK)
        .unwrap()
        .into_iter()
        .map(std::sync::Arc::new)
        .collect();
    SharedStart {
        a,
        b,
        maker,
        blocks,
    }
}

/// A session over the full cache that prefilled `ids`.
fn prefilled(ids: &[u32]) -> kvchat::session::Session<'static> {
    let mut s = engine().session(&full());
    logits(&mut s, ids);
    s
}

/// Greedy steps from `first`: each step's logits.
fn steps(s: &mut kvchat::session::Session<'_>, first: u32, n: usize) -> Vec<Vec<f32>> {
    let mut tok = first;
    (0..n)
        .map(|_| {
            let l = logits(s, &[tok]);
            tok = kvchat::session::argmax(&l);
            l
        })
        .collect()
}

#[test]
fn a_session_attending_to_shared_blocks_gets_the_bits_of_one_prefill_and_of_each_step_after() {
    let e = engine();
    let SharedStart { b, blocks, .. } = shared_start();
    let mut sharing = e.session(&full());
    let n = sharing.adopt_blocks(&b, &blocks).unwrap();
    assert_eq!(n, blocks.len() * kvchat::kv::SHARED_BLOCK);
    assert!(n >= 128, "{n}");
    let mut alone = e.session(&full());
    let (ls, la) = (logits(&mut sharing, &b[n..]), logits(&mut alone, &b));
    assert_eq!(ls, la);
    let first = kvchat::session::argmax(&la);
    assert_eq!(steps(&mut sharing, first, 24), steps(&mut alone, first, 24));
    // Its own store holds only what follows the shared blocks.
    assert!(sharing.cache().bytes() < alone.cache().bytes());
}

#[test]
fn going_back_into_shared_blocks_copies_the_rest_of_the_block_and_stays_exact() {
    let e = engine();
    let SharedStart {
        a,
        b,
        mut maker,
        blocks,
    } = shared_start();
    let mut sharing = e.session(&full());
    let n = sharing.adopt_blocks(&b, &blocks).unwrap();
    logits(&mut sharing, &b[n..]);
    let back = n - 10;
    sharing.truncate(back).unwrap();
    assert_eq!(sharing.tokens(), &b[..back]);
    let mut alone = e.session(&full());
    assert_eq!(logits(&mut sharing, &b[back..]), logits(&mut alone, &b));
    // The shared block was not written: the maker still steps as a session that never shared.
    let mut control = prefilled(&a);
    assert_eq!(steps(&mut maker, 42, 4), steps(&mut control, 42, 4));
}

#[test]
fn a_session_adopting_blocks_made_from_its_own_rows_gives_its_copy_up_and_steps_as_before() {
    let SharedStart {
        a,
        mut maker,
        blocks,
        ..
    } = shared_start();
    let before = maker.cache().bytes();
    assert_eq!(
        maker.adopt_blocks(&a, &blocks).unwrap(),
        blocks.len() * kvchat::kv::SHARED_BLOCK
    );
    assert_eq!(maker.tokens(), &a[..]);
    assert!(
        maker.cache().bytes() < before,
        "{} ≥ {before}",
        maker.cache().bytes()
    );
    let mut control = prefilled(&a);
    assert_eq!(steps(&mut maker, 42, 8), steps(&mut control, 42, 8));
}

#[test]
fn blocks_of_other_tokens_are_refused_and_change_nothing() {
    let e = engine();
    let SharedStart { b, blocks, .. } = shared_start();
    let other = e.raw_prompt(&"Another text entirely. ".repeat(40)).unwrap();
    let mut s = e.session(&full());
    let err = s.adopt_blocks(&other, &blocks).unwrap_err().to_string();
    assert!(err.contains("do not hold this sequence's first"), "{err}");
    assert!(s.tokens().is_empty());
    let int8 = full().with(|m| m.precision = kvchat::kv::Precision::Int8);
    let mut q = e.session(&int8);
    let err = q.adopt_blocks(&b, &blocks).unwrap_err().to_string();
    assert!(err.contains("float cache"), "{err}");
}

#[test]
fn no_cache_allocates_more_than_a_server_counts_for_it_at_any_length_on_any_axis() {
    use kvchat::kv::size::KvDims;
    let e = engine();
    let prompt = e
        .raw_prompt(&kvchat::eval::bench::BENCH_TEXT[..2400])
        .unwrap();
    let positions = prompt.len() + 40;
    // Stores growing by doubling (one sequence), or 16 positions at a time (a server's pool).
    for (mode, grow_by) in [
        "full",
        "full+int8",
        "window:64+4",
        "window:128+4+int4",
        "budget:96",
    ]
    .into_iter()
    .flat_map(|m| [(m, None), (m, Some(16))])
    {
        let spec = kvchat::kv::CacheSpec {
            max_positions: positions,
            grow_by,
            ..e.cache_spec(&mode.parse::<kvchat::kv::CacheMode>().unwrap(), e.ctx())
                .unwrap()
        };
        let bound =
            KvDims::bytes_at_most(&spec, &e.model().cfg, prompt.len(), e.model().prefill_chunk);
        let mut s = kvchat::session::Session::new(
            e.model(),
            spec.build(&e.model().cfg, e.kv_device()),
            positions,
        );
        let chunk = e.model().prefill_chunk;
        // What a server counts the sequence for at each length: at least what it holds, and
        // exactly that when every position is kept.
        let check = |s: &kvchat::session::Session| {
            let n = s.tokens().len();
            let now = KvDims::bytes_up_to(&spec, &e.model().cfg, prompt.len(), chunk, n);
            let held = s.cache().bytes() as f64;
            assert!(
                held <= now,
                "{mode} {grow_by:?} at {n}: {held} bytes held, {now} counted"
            );
            if mode.starts_with("full") {
                assert_eq!(held, now, "{mode} {grow_by:?} at {n}");
            }
        };
        let mut tok = kvchat::session::argmax(&logits(&mut s, &prompt));
        check(&s);
        let mut most = s.cache().bytes();
        for _ in 0..39 {
            tok = kvchat::session::argmax(&logits(&mut s, &[tok]));
            check(&s);
            most = most.max(s.cache().bytes());
        }
        assert!(
            most as f64 <= bound,
            "{mode}: {most} bytes allocated, {bound} reserved"
        );
        // (A budget holds the whole prompt only inside its forward, which this cannot see.)
        if !mode.starts_with("budget") {
            assert!(
                most as f64 > 0.5 * bound,
                "{mode}: the bound {bound} is loose ({most})"
            );
        }
    }
}
