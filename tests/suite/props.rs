//! Property tests over everything that parses input from outside (issue 10): GGUF metadata into a
//! model config, KV file headers, model references, and models.toml. The property is always the same
//! pair: no input makes the parser panic, and whatever it accepts is safe to use (sizes within
//! bounds, names that cannot leave a directory).

use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use kvchat::kv::persist;
use kvchat::model::Config;
use kvchat::source::{ModelRef, Registry, Source};
use proptest::prelude::*;
use std::collections::HashMap;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Any GGUF metadata value a hostile file could hold for a numeric key.
fn any_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<f32>().prop_map(Value::F32),
        any::<f64>().prop_map(Value::F64),
        any::<bool>().prop_map(Value::Bool),
        "[a-z]{0,8}".prop_map(Value::String),
        (0u32..64).prop_map(Value::U32),
        (0u32..64).prop_map(|n| Value::Array(vec![Value::U32(n)])),
    ]
}

const KEYS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "vocab_size",
];

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn gguf_metadata_never_panics_the_config_reader_and_what_it_accepts_is_bounded(
        edits in proptest::collection::vec(
            (0..KEYS.len(), proptest::option::of(any_value())),
            0..4,
        ),
        arch in prop_oneof![Just("llama"), Just("qwen2"), Just("mistral"), Just("gpt9")],
        embd_dims in proptest::option::of(proptest::collection::vec(0usize..1 << 34, 0..3)),
    ) {
        // A sound model's metadata, then up to 3 keys replaced by anything or removed: both the
        // accepting and the refusing side of the reader are exercised.
        let sound: [(&str, Value); 7] = [
            ("block_count", Value::U32(30)),
            ("context_length", Value::U32(8192)),
            ("embedding_length", Value::U32(576)),
            ("feed_forward_length", Value::U32(1536)),
            ("attention.head_count", Value::U32(9)),
            ("attention.head_count_kv", Value::U32(3)),
            ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ];
        let mut metadata = HashMap::new();
        metadata.insert("general.architecture".to_string(), Value::String(arch.into()));
        for (k, v) in sound {
            metadata.insert(format!("{arch}.{k}"), v);
        }
        for (i, v) in edits {
            let key = format!("{arch}.{}", KEYS[i]);
            match v {
                Some(v) => metadata.insert(key, v),
                None => metadata.remove(&key),
            };
        }
        let mut tensor_infos = HashMap::new();
        if let Some(dims) = embd_dims {
            tensor_infos.insert(
                "token_embd.weight".to_string(),
                candle_core::quantized::gguf_file::TensorInfo {
                    ggml_dtype: candle_core::quantized::GgmlDType::F32,
                    shape: candle_core::Shape::from(dims),
                    offset: 0,
                },
            );
        } else {
            metadata.insert(format!("{arch}.vocab_size"), Value::U32(49152));
        }
        let ct = Content { magic: VersionedMagic::GgufV3, metadata, tensor_infos, tensor_data_offset: 0 };
        if let Ok(cfg) = Config::from_gguf(&ct) {
            prop_assert!(cfg.n_layer >= 1 && cfg.n_layer <= 4096);
            prop_assert!(cfg.n_head >= 1 && cfg.n_kv_head >= 1 && cfg.n_head % cfg.n_kv_head == 0);
            prop_assert!(cfg.head_dim >= 1 && cfg.head_dim <= 4096);
            prop_assert!(cfg.rope_dim >= 2 && cfg.rope_dim <= cfg.head_dim && cfg.rope_dim % 2 == 0);
            prop_assert!(cfg.vocab >= 1 && cfg.vocab <= 1 << 23);
            prop_assert!(cfg.ctx_train <= 1 << 26);
            prop_assert!(cfg.rms_eps > 0.0 && cfg.rms_eps < 1.0);
            prop_assert!(cfg.rope_base.is_finite() && cfg.rope_base > 0.0);
        }
    }
}

#[test]
fn the_sound_metadata_of_the_property_is_accepted() {
    let mut metadata = HashMap::new();
    metadata.insert(
        "general.architecture".to_string(),
        Value::String("llama".into()),
    );
    for (k, v) in [
        ("block_count", 30u32),
        ("context_length", 8192),
        ("embedding_length", 576),
        ("feed_forward_length", 1536),
        ("attention.head_count", 9),
        ("attention.head_count_kv", 3),
        ("vocab_size", 49152),
    ] {
        metadata.insert(format!("llama.{k}"), Value::U32(v));
    }
    metadata.insert(
        "llama.attention.layer_norm_rms_epsilon".into(),
        Value::F32(1e-5),
    );
    let ct = Content {
        magic: VersionedMagic::GgufV3,
        metadata,
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    };
    let cfg = Config::from_gguf(&ct).unwrap();
    assert_eq!((cfg.n_layer, cfg.head_dim, cfg.vocab), (30, 64, 49152));
}

fn expect() -> persist::Expect<'static> {
    persist::Expect {
        model_digest: "m",
        cache_key: "all, f32",
        shapes: vec![(2, 4); 2],
        max_positions: 64,
        states: Vec::new(),
    }
}

/// A layer of the cache `expect()` describes: f32, every position, 2 heads of 4 values.
fn layer_f32() -> kvchat::kv::Layer {
    kvchat::kv::Layer::new(
        &kvchat::kv::LayerSpec {
            precision: kvchat::kv::Precision::F32,
            retention: kvchat::kv::Retention::All,
            offload: false,
            residual: 0,
            max_positions: 64,
            attend_window: None,
            grow_by: None,
        },
        2,
        4,
        None,
    )
}

/// A valid KV file for `expect()`: 3 positions.
fn valid_kv_file() -> Vec<u8> {
    use candle_core::{Device, Tensor};
    let mut tensors = vec![(
        "tokens".to_string(),
        Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap(),
    )];
    // Each layer: 2 heads × 3 positions × 4 f32 values of 1.0, as bytes.
    let row: Vec<u8> = (0..2 * 3 * 4).flat_map(|_| 1f32.to_le_bytes()).collect();
    for i in 0..2 {
        for kv in ["k", "v"] {
            tensors.push((
                format!("{kv}.{i}"),
                Tensor::from_vec(row.clone(), (2, 48), &Device::Cpu).unwrap(),
            ));
        }
    }
    let meta: HashMap<String, String> = [
        ("format", persist::FORMAT),
        ("model", "m"),
        ("cache", "all, f32"),
        ("extra", "{}"),
        ("residual_from", "3"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    safetensors::serialize(tensors.iter().map(|(k, t)| (k.as_str(), t)), Some(meta)).unwrap()
}

#[test]
fn the_valid_kv_file_of_the_properties_loads() {
    let dir = std::env::temp_dir().join(format!("kvchat-props-valid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("ok.kvc");
    std::fs::write(&p, valid_kv_file()).unwrap();
    assert!(persist::check_target(&p).unwrap());
    let snap = persist::load(&p, &expect()).unwrap();
    assert_eq!(snap.tokens, [1, 2, 3]);
    layer_f32().restore_raw(3, &snap.layers[0]).unwrap();
}

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn kv_files_with_any_bytes_changed_never_panic_and_load_only_when_sound(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = valid_kv_file();
        for (i, b) in edits {
            let at = i.index(bytes.len());
            bytes[at] = b;
        }
        if let Some(c) = cut {
            let n = c.index(bytes.len());
            bytes.truncate(n);
        }
        let dir = std::env::temp_dir().join(format!("kvchat-props-kv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f.kvc");
        std::fs::write(&p, &bytes).unwrap();
        let _ = persist::check_target(&p);
        if let Ok(snap) = persist::load(&p, &expect()) {
            prop_assert!(!snap.tokens.is_empty() && snap.tokens.len() < 64);
            prop_assert_eq!(snap.layers.len(), 2);
            // What a layer accepts of it holds exactly the tokens' positions, all finite.
            for st in &snap.layers {
                let mut layer = layer_f32();
                if layer.restore_raw(snap.tokens.len(), st).is_ok() {
                    use kvchat::model::cache::LayerCache;
                    prop_assert_eq!(layer.len(), snap.tokens.len());
                    let back = layer.raw_state().unwrap();
                    let xs: Vec<f32> = back.k.chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect();
                    prop_assert!(xs.iter().all(|x| x.is_finite()));
                }
            }
        }
    }

    #[test]
    fn kv_headers_of_random_bytes_are_never_taken_for_a_kv_file(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let dir = std::env::temp_dir().join(format!("kvchat-props-rand-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("r.kvc");
        std::fs::write(&p, &bytes).unwrap();
        prop_assert!(persist::check_target(&p).is_err());
        prop_assert!(persist::load(&p, &expect()).is_err());
    }
}

/// Whether `name`, joined under a directory, can only name something inside it.
fn stays_inside(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains('\\'))
}

proptest! {
    #![proptest_config(config(3000))]

    #[test]
    fn model_references_never_panic_and_accepted_hub_refs_stay_inside_the_cache(
        spec in prop_oneof![
            "hf:[a-zA-Z0-9./_@:\\\\-]{0,40}",
            "hf:[a-z]{1,4}/[a-z.]{1,6}(@[a-z./]{1,10})?(:[a-z./]{1,12})?",
            "[a-zA-Z0-9./_@:-]{0,30}",
            any::<String>(),
        ],
    ) {
        if let Ok(ModelRef::Hub(Source::Hf { repo, revision, file, .. })) = ModelRef::parse(&spec) {
            prop_assert!(stays_inside(&repo) && repo.split('/').count() == 2, "{}", repo);
            prop_assert!(!repo.contains("--"));
            prop_assert!(stays_inside(&revision), "{}", revision);
            if let Some(f) = file {
                prop_assert!(stays_inside(&f), "{}", f);
            }
        }
    }

    #[test]
    fn models_toml_entries_never_panic_and_accepted_ones_name_only_safe_paths(
        repo in "[a-z./\\\\-]{0,12}",
        revision in "[a-z./-]{0,12}",
        file in "[a-z./\\\\-]{0,16}",
        member in "[a-z./-]{0,16}",
        package in "[a-z./-]{0,8}",
        version in "[0-9./a-z]{0,8}",
    ) {
        let sha = "0".repeat(64);
        let text = format!(
            "default = \"m\"\n[models.m]\ndescription = \"d\"\n\
             [[models.m.sources]]\ntype = \"hf\"\nrepo = \"{repo}\"\nrevision = \"{revision}\"\nfile = \"{file}\"\n\
             [[models.m.sources]]\ntype = \"pip\"\npackage = \"{package}\"\nversion = \"{version}\"\nmember = \"{member}\"\nsha256 = \"{sha}\"\n"
        );
        if let Ok(reg) = Registry::parse(&text, "prop") {
            for s in &reg.get("m").unwrap().sources {
                match s {
                    Source::Hf { repo, revision, file, .. } => {
                        prop_assert!(stays_inside(repo) && stays_inside(revision));
                        prop_assert!(file.as_deref().is_none_or(stays_inside));
                    }
                    Source::Pip { member, package, version, .. } => {
                        prop_assert!(stays_inside(member));
                        prop_assert!(!package.contains('/') && !version.contains('/'));
                        let dest = kvchat::source::pip_dest(member);
                        let models = kvchat::source::kvchat_home().join("models");
                        prop_assert_eq!(dest.parent(), Some(models.as_path()));
                    }
                    Source::PipParts { file, parts, .. } => {
                        prop_assert!(stays_inside(file) && !file.contains('/'), "{}", file);
                        for p in parts {
                            prop_assert!(stays_inside(&p.member));
                        }
                        let dest = kvchat::source::pip_dest(file);
                        let models = kvchat::source::kvchat_home().join("models");
                        prop_assert_eq!(dest.parent(), Some(models.as_path()));
                    }
                }
            }
        }
    }

    #[test]
    fn pip_parts_entries_never_panic_and_accepted_ones_write_only_into_models(
        file in "[a-z./\\\\-]{0,16}",
        member in "[a-z./-]{0,16}",
        package in "[a-z./-]{0,8}",
    ) {
        let sha = "0".repeat(64);
        let text = format!(
            "default = \"m\"\n[models.m]\ndescription = \"d\"\n\
             [[models.m.sources]]\ntype = \"pip-parts\"\nfile = \"{file}\"\nsha256 = \"{sha}\"\n\
             parts = [{{ package = \"{package}\", version = \"1\", member = \"{member}\" }}]\n"
        );
        if let Ok(reg) = Registry::parse(&text, "prop") {
            for s in &reg.get("m").unwrap().sources {
                if let Source::PipParts { file, parts, .. } = s {
                    prop_assert!(stays_inside(file) && !file.contains('/'), "{}", file);
                    for p in parts {
                        prop_assert!(stays_inside(&p.member), "{}", p.member);
                    }
                    let dest = kvchat::source::pip_dest(file);
                    let models = kvchat::source::kvchat_home().join("models");
                    prop_assert_eq!(dest.parent(), Some(models.as_path()));
                }
            }
        }
    }

    #[test]
    fn the_tensor_type_scan_never_panics_on_any_header(
        tail in proptest::collection::vec(any::<u8>(), 0..256),
        version in 0u32..5,
        n_tensors in 0u64..4,
        n_kv in 0u64..4,
    ) {
        // A GGUF magic, then counts and bytes that may say anything.
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b.extend(&tail);
        let p = std::env::temp_dir().join(format!("kvchat-scan-{}.gguf", std::process::id()));
        std::fs::write(&p, &b).unwrap();
        if let Some(types) = kvchat::model::gguf_types::tensor_types(&p) {
            let _ = kvchat::model::gguf_types::unsupported_tensor(&types);
        }
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn arbitrary_toml_text_never_panics_the_registry_parser(text in any::<String>()) {
        let _ = Registry::parse(&text, "prop");
    }
}

#[test]
fn the_stays_inside_oracle_rejects_escapes() {
    assert!(!stays_inside("../x"));
    assert!(!stays_inside("/x"));
    assert!(!stays_inside("a//b"));
    assert!(stays_inside("a/b.gguf"));
}
