//! A model's recommended sampling settings, as far as something states them: the GGUF's
//! `general.sampling.*` keys (the ones llama.cpp reads), a Hugging Face `generation_config.json`, or a
//! `[models.NAME.sampling]` table in models.toml. Each is a partial set ([`SamplingPrefs`]); the
//! session layers them (flag > registry > model file > built-in).

use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;

/// Sampling settings one source states; `None` = it says nothing about that one.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingPrefs {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<usize>,
    pub seed: Option<u64>,
}

/// A sampling setting, by name: its place in [`SETTINGS`] and among a resolved set's origins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    Temperature,
    TopK,
    TopP,
    MinP,
    RepeatPenalty,
    RepeatLastN,
    Seed,
}

impl Setting {
    /// As `/set` and the flags name it.
    pub fn name(self) -> &'static str {
        SETTINGS[self as usize]
    }
}

/// The settings' names, in [`Setting`]'s order (as `/set` takes them).
pub const SETTINGS: [&str; 7] = [
    "temperature",
    "top-k",
    "top-p",
    "min-p",
    "repeat-penalty",
    "repeat-last-n",
    "seed",
];

impl SamplingPrefs {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// What is wrong with the values it states, as (setting, why) pairs; empty when all are usable.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(t) = self.temperature {
            if !(t >= 0.0 && t.is_finite()) {
                out.push(("temperature", format!("must be a number ≥ 0, got {t}")));
            }
        }
        for (name, v) in [("top-p", self.top_p), ("min-p", self.min_p)] {
            if let Some(v) = v {
                if !(0.0..=1.0).contains(&v) {
                    out.push((name, format!("must be between 0 and 1, got {v}")));
                }
            }
        }
        if let Some(r) = self.repeat_penalty {
            if !(r > 0.0 && r.is_finite()) {
                out.push(("repeat-penalty", format!("must be > 0, got {r}")));
            }
        }
        out
    }

    /// Sets one setting (named as in [`SETTINGS`]) from text, as `/set NAME VALUE` does.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{name}: '{v}' is not a number of the right kind"))
        }
        let mut next = self.clone();
        match name {
            "temperature" => next.temperature = Some(num(name, value)?),
            "top-k" => next.top_k = Some(num(name, value)?),
            "top-p" => next.top_p = Some(num(name, value)?),
            "min-p" => next.min_p = Some(num(name, value)?),
            "repeat-penalty" => next.repeat_penalty = Some(num(name, value)?),
            "repeat-last-n" => next.repeat_last_n = Some(num(name, value)?),
            "seed" => next.seed = Some(num(name, value)?),
            other => {
                return Err(format!(
                    "unknown setting '{other}' (one of {}){}",
                    SETTINGS.join(", "),
                    crate::did_you_mean(other, SETTINGS.iter().copied())
                ))
            }
        }
        if let Some((_, why)) = next.problems().into_iter().next() {
            return Err(format!("{name} {why}"));
        }
        *self = next;
        Ok(())
    }

    /// Drops the values that are unusable (a model file's recommendation is advice: a bad one must
    /// not stop the run, nor be used), adding a note for each to `notes`.
    pub fn usable(mut self, origin: &str, notes: &mut Vec<String>) -> Self {
        for (name, why) in self.problems() {
            notes.push(format!("ignoring {origin}'s {name}: it {why}"));
            match name {
                "temperature" => self.temperature = None,
                "top-p" => self.top_p = None,
                "min-p" => self.min_p = None,
                _ => self.repeat_penalty = None,
            }
        }
        self
    }

    /// The `general.sampling.*` keys of a GGUF's metadata (llama.cpp's names); a note in `notes`
    /// for each unusable value dropped.
    pub fn from_gguf(md: &HashMap<String, Value>, notes: &mut Vec<String>) -> Self {
        let float = |k: &str| -> Option<f32> {
            match md.get(k)? {
                Value::F32(v) => Some(*v),
                Value::F64(v) => Some(*v as f32),
                other => int(other).map(|i| i as f32),
            }
        };
        let count = |k: &str| -> Option<usize> { usize::try_from(int(md.get(k)?)?).ok() };
        Self {
            temperature: float("general.sampling.temp"),
            top_k: count("general.sampling.top_k"),
            top_p: float("general.sampling.top_p"),
            min_p: float("general.sampling.min_p"),
            repeat_penalty: float("general.sampling.penalty_repeat"),
            repeat_last_n: count("general.sampling.penalty_last_n"),
            seed: None,
        }
        .usable("the GGUF's general.sampling", notes)
    }

    /// A Hugging Face `generation_config.json` (already parsed): temperature, top_k, top_p, min_p,
    /// repetition_penalty; `do_sample: false` means greedy.
    pub fn from_generation_config(j: &serde_json::Value, notes: &mut Vec<String>) -> Self {
        let float = |k: &str| j.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
        let greedy = j.get("do_sample").and_then(|v| v.as_bool()) == Some(false);
        Self {
            temperature: if greedy {
                Some(0.0)
            } else {
                float("temperature")
            },
            top_k: j
                .get("top_k")
                .and_then(|v| v.as_u64())
                .and_then(|v| usize::try_from(v).ok()),
            top_p: float("top_p"),
            min_p: float("min_p"),
            repeat_penalty: float("repetition_penalty"),
            repeat_last_n: None,
            seed: None,
        }
        .usable("generation_config.json", notes)
    }
}

/// A GGUF integer of any width, as i64 (None for other types or a u64 past i64).
fn int(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_sampling_keys_are_read_with_llama_cpp_names() {
        let md: HashMap<String, Value> = [
            ("general.sampling.temp", Value::F32(0.6)),
            ("general.sampling.top_k", Value::U32(20)),
            ("general.sampling.top_p", Value::F32(0.95)),
            ("general.sampling.min_p", Value::F64(0.0)),
            ("general.sampling.penalty_repeat", Value::F32(1.05)),
            ("general.sampling.penalty_last_n", Value::I32(128)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let p = SamplingPrefs::from_gguf(&md, &mut Vec::new());
        assert_eq!(p.temperature, Some(0.6));
        assert_eq!(p.top_k, Some(20));
        assert_eq!(p.top_p, Some(0.95));
        assert_eq!(p.min_p, Some(0.0), "a stated zero is a choice, kept");
        assert_eq!(p.repeat_penalty, Some(1.05));
        assert_eq!(p.repeat_last_n, Some(128));
    }

    #[test]
    fn a_gguf_without_sampling_keys_states_nothing() {
        assert!(SamplingPrefs::from_gguf(&HashMap::new(), &mut Vec::new()).is_empty());
    }

    #[test]
    fn an_unusable_recommendation_is_dropped_not_used() {
        let md: HashMap<String, Value> = [
            ("general.sampling.temp".to_string(), Value::F32(-1.0)),
            ("general.sampling.top_p".to_string(), Value::F32(0.5)),
        ]
        .into();
        let mut notes = Vec::new();
        let p = SamplingPrefs::from_gguf(&md, &mut notes);
        assert_eq!(p.temperature, None);
        assert_eq!(p.top_p, Some(0.5));
        assert_eq!(
            notes,
            ["ignoring the GGUF's general.sampling's temperature: it must be a number ≥ 0, got -1"]
        );
    }

    #[test]
    fn generation_config_maps_hf_names_and_do_sample_false_is_greedy() {
        let j = serde_json::json!({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "repetition_penalty": 1.05, "bos_token_id": 1});
        let p = SamplingPrefs::from_generation_config(&j, &mut Vec::new());
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.repeat_penalty),
            (Some(0.7), Some(0.8), Some(20), Some(1.05))
        );
        let greedy = serde_json::json!({"do_sample": false, "temperature": 0.7});
        assert_eq!(
            SamplingPrefs::from_generation_config(&greedy, &mut Vec::new()).temperature,
            Some(0.0)
        );
    }

    #[test]
    fn set_parses_checks_and_suggests() {
        let mut p = SamplingPrefs::default();
        p.set("temperature", "0.3").unwrap();
        p.set("top-k", "7").unwrap();
        assert_eq!((p.temperature, p.top_k), (Some(0.3), Some(7)));
        assert!(p
            .set("top-p", "1.5")
            .unwrap_err()
            .contains("between 0 and 1"));
        assert_eq!(p.top_p, None, "a refused value changes nothing");
        assert!(p
            .set("temprature", "1")
            .unwrap_err()
            .contains("temperature"));
        assert!(p.set("seed", "x").unwrap_err().contains("'x'"));
    }
}
