//! Picking the next token: temperature, top-k, top-p, min-p and a repeat penalty (llama.cpp's
//! defaults), from a seeded generator; and which settings are in force ([`Resolved`]: a flag, else the
//! registry's recommendation, else the model file's, else the built-in default; a random seed unless
//! one is given).

use crate::grammar::Constraint;
use crate::model::sampling::{SamplingPrefs, Setting, SETTINGS};
use anyhow::Result;
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings; the defaults are llama.cpp's.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy argmax.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    /// 1.0 = off.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 42,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

/// The settings in force and where each came from ("flag", "models.toml", "model file", "built-in",
/// "random", "/set").
#[derive(Debug, Clone)]
pub struct Resolved {
    pub params: SamplingParams,
    /// One origin per entry of [`SETTINGS`], in that order (read by [`Resolved::origin`]).
    origins: [String; 7],
}

impl Resolved {
    /// `layers` (most important first) over the built-in defaults. A seed no layer states is drawn
    /// at random, so a bad sampled answer does not repeat on every rerun (`--seed` fixes it).
    pub fn from_layers(layers: &[(&str, &SamplingPrefs)]) -> Self {
        let mut r = Self {
            params: SamplingParams::default(),
            origins: std::array::from_fn(|_| "built-in".to_string()),
        };
        for (origin, prefs) in layers.iter().rev() {
            r.apply(prefs, origin);
        }
        if r.origin(Setting::Seed) == "built-in" {
            r.params.seed = u64::from(rand::random::<u32>());
            r.origins[Setting::Seed as usize] = "random".into();
        }
        r
    }

    /// Where the value in force of `setting` came from.
    pub fn origin(&self, setting: Setting) -> &str {
        &self.origins[setting as usize]
    }

    /// Overrides what `prefs` states, recording `origin` for each.
    pub fn apply(&mut self, prefs: &SamplingPrefs, origin: &str) {
        let p = &mut self.params;
        let stated = [
            prefs.temperature.map(|v| p.temperature = v),
            prefs.top_k.map(|v| p.top_k = v),
            prefs.top_p.map(|v| p.top_p = v),
            prefs.min_p.map(|v| p.min_p = v),
            prefs.repeat_penalty.map(|v| p.repeat_penalty = v),
            prefs.repeat_last_n.map(|v| p.repeat_last_n = v),
            prefs.seed.map(|v| p.seed = v),
        ];
        for (i, s) in stated.iter().enumerate() {
            if s.is_some() {
                self.origins[i] = origin.to_string();
            }
        }
    }

    /// One line: each setting, its value and (when not built in) where it came from.
    pub fn describe(&self) -> String {
        let p = &self.params;
        let values = [
            format!("{}", p.temperature),
            p.top_k.to_string(),
            format!("{}", p.top_p),
            format!("{}", p.min_p),
            format!("{}", p.repeat_penalty),
            p.repeat_last_n.to_string(),
            p.seed.to_string(),
        ];
        SETTINGS
            .iter()
            .zip(values)
            .zip(&self.origins)
            .map(|((name, v), o)| {
                if o == "built-in" {
                    format!("{name} {v}")
                } else {
                    format!("{name} {v} ({o})")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

pub struct Sampler {
    p: SamplingParams,
    rng: StdRng,
    /// Each pick with the runner-up's logit, when traced ([`Sampler::trace`]).
    picks: Option<Vec<Pick>>,
    /// The grammar the answer keeps to, if any ([`Sampler::constrain`]).
    constraint: Option<Constraint>,
}

/// One sampled token beside the next most likely one, by the logits it was picked from (after
/// the repeat penalty): how near a tie the pick was.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    pub token: u32,
    pub logit: f32,
    pub runner_up: u32,
    pub runner_up_logit: f32,
}

impl Sampler {
    pub fn new(p: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(p.seed);
        Self {
            p,
            rng,
            picks: None,
            constraint: None,
        }
    }

    /// From now on every pick keeps to `constraint`'s grammar: the tokens it does not allow are
    /// never picked, and each pick moves it on.
    pub fn constrain(&mut self, constraint: Constraint) {
        self.constraint = Some(constraint);
    }

    /// Records every pick from now on (read by [`Sampler::picks`]): where two devices' greedy
    /// answers part, the logits say whether it was a near-tie.
    pub fn trace(&mut self) {
        self.picks = Some(Vec::new());
    }

    /// The picks recorded since [`Sampler::trace`] (none when not traced).
    pub fn picks(&self) -> &[Pick] {
        self.picks.as_deref().unwrap_or_default()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.p
    }

    /// New settings from now on; the generator restarts only when the seed changes.
    pub fn update(&mut self, p: SamplingParams) {
        if p.seed != self.p.seed {
            self.rng = StdRng::seed_from_u64(p.seed);
        }
        self.p = p;
    }

    /// Restarts the generator from the seed: what follows is sampled as in a run started now.
    pub fn reseed(&mut self) {
        self.rng = StdRng::seed_from_u64(self.p.seed);
    }

    /// Picks the next token from `logits` [vocab]; `recent` are the tokens the repeat penalty looks at.
    pub fn sample(&mut self, logits: &Tensor, recent: &[u32]) -> Result<u32> {
        let mut logits: Vec<f32> = logits.to_vec1()?;
        // NaN or +∞ comes only from weights that hold them (a damaged or hostile file): any
        // token picked from such logits would be a silent wrong answer.
        if let Some(i) = logits
            .iter()
            .position(|x| x.is_nan() || *x == f32::INFINITY)
        {
            anyhow::bail!(
                "the model computed a non-finite logit ({} for token {i}): its weights hold non-finite values; is the model file damaged?",
                logits[i]
            );
        }
        let p = &self.p;
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = recent.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &recent[start..] {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repeat_penalty
                        } else {
                            *l * p.repeat_penalty
                        };
                    }
                }
            }
        }
        if let Some(c) = &mut self.constraint {
            c.apply(&mut logits)?;
        }
        let token = self.choose(&logits);
        if let Some(c) = &mut self.constraint {
            c.commit(token)?;
        }
        if let Some(picks) = &mut self.picks {
            let runner_up = argmax_except(&logits, token);
            picks.push(Pick {
                token,
                logit: logits[token as usize],
                runner_up,
                runner_up_logit: logits.get(runner_up as usize).copied().unwrap_or(f32::NAN),
            });
        }
        Ok(token)
    }

    /// The token the settings pick from `logits` (penalised already).
    fn choose(&mut self, logits: &[f32]) -> u32 {
        let p = &self.p;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        // Candidates sorted by logit, cut by top-k.
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = if p.top_k == 0 {
            idx.len()
        } else {
            p.top_k.min(idx.len())
        };
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        idx.truncate(k);
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        // Softmax at temperature over the candidates.
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) / p.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        // min-p: drop what is less likely than min_p × the top probability.
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        }
        // top-p: the smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for &x in &probs[..keep] {
                acc += x;
                n += 1;
                if acc >= p.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for (i, &x) in probs[..keep].iter().enumerate() {
            r -= x;
            if r <= 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in xs.iter().enumerate() {
        if *x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// The index of the largest of `xs` other than `skip` (`skip` itself when `xs` has one entry).
fn argmax_except(xs: &[f32], skip: u32) -> u32 {
    let mut best: Option<usize> = None;
    for (i, x) in xs.iter().enumerate() {
        if i != skip as usize && best.is_none_or(|b| *x > xs[b]) {
            best = Some(i);
        }
    }
    best.map_or(skip, |b| b as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits(xs: &[f32]) -> Tensor {
        Tensor::new(xs, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_traced_pick_names_the_runner_up_and_both_logits_after_the_penalty() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..SamplingParams::greedy()
        });
        assert!(s.picks().is_empty());
        s.trace();
        // Token 1 (3.0) is recent: penalised to 1.5, below token 2's 2.9 and above token 0's 1.0.
        assert_eq!(s.sample(&logits(&[1.0, 3.0, 2.9, -1.0]), &[1]).unwrap(), 2);
        assert_eq!(s.sample(&logits(&[4.0, 3.5]), &[]).unwrap(), 0);
        assert_eq!(
            s.picks(),
            [
                Pick {
                    token: 2,
                    logit: 2.9,
                    runner_up: 1,
                    runner_up_logit: 1.5
                },
                Pick {
                    token: 0,
                    logit: 4.0,
                    runner_up: 1,
                    runner_up_logit: 3.5
                }
            ]
        );
    }

    #[test]
    fn a_nan_or_infinite_logit_is_an_error_naming_the_token_not_a_pick() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let err = s.sample(&logits(&[0.1, f32::NAN, 2.0]), &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("non-finite logit (NaN for token 1)"),
            "{err}"
        );
        let err = s.sample(&logits(&[f32::INFINITY, 1.0]), &[]).unwrap_err();
        assert!(err.to_string().contains("(inf for token 0)"), "{err}");
        // −∞ is a token ruled out, not damage.
        assert_eq!(
            s.sample(&logits(&[f32::NEG_INFINITY, 1.0]), &[]).unwrap(),
            1
        );
    }

    #[test]
    fn temperature_zero_is_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&logits(&[0.1, 3.0, 2.9, -1.0]), &[]).unwrap(), 1);
    }

    #[test]
    fn top_k_one_is_the_argmax_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&logits(&[0.1, 3.0, 2.9, -1.0]), &[]).unwrap(), 1);
        }
    }

    #[test]
    fn the_same_seed_samples_the_same_tokens() {
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.5,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed,
                ..SamplingParams::default()
            });
            (0..32)
                .map(|_| s.sample(&logits(&[1.0, 1.1, 0.9, 1.05]), &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn the_repeat_penalty_turns_the_choice_away_from_recent_tokens() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            repeat_penalty: 2.0,
            ..SamplingParams::default()
        });
        // Token 1 leads by a little, but it was just said: halved, it falls behind token 2.
        assert_eq!(s.sample(&logits(&[0.0, 3.0, 2.0]), &[1]).unwrap(), 2);
    }

    #[test]
    fn a_flag_beats_the_registry_which_beats_the_model_file() {
        let flag = SamplingPrefs {
            top_k: Some(5),
            ..Default::default()
        };
        let registry = SamplingPrefs {
            temperature: Some(0.2),
            top_k: Some(50),
            ..Default::default()
        };
        let file = SamplingPrefs {
            temperature: Some(0.7),
            top_p: Some(0.8),
            ..Default::default()
        };
        let r = Resolved::from_layers(&[
            ("flag", &flag),
            ("models.toml", &registry),
            ("model file", &file),
        ]);
        assert_eq!(r.params.top_k, 5);
        assert_eq!(r.params.temperature, 0.2);
        assert_eq!(r.params.top_p, 0.8);
        assert_eq!(r.params.min_p, 0.05, "nobody said: the built-in default");
        assert_eq!(
            [
                Setting::Temperature,
                Setting::TopK,
                Setting::TopP,
                Setting::MinP
            ]
            .map(|s| r.origin(s)),
            ["models.toml", "flag", "model file", "built-in"]
        );
        assert!(r.describe().contains("temperature 0.2 (models.toml)"));
    }

    #[test]
    fn the_seed_is_random_unless_given() {
        let seeds: std::collections::HashSet<u64> = (0..8)
            .map(|_| Resolved::from_layers(&[]).params.seed)
            .collect();
        assert!(seeds.len() > 1, "eight draws gave one seed");
        assert_eq!(Resolved::from_layers(&[]).origin(Setting::Seed), "random");
        let fixed = SamplingPrefs {
            seed: Some(7),
            ..Default::default()
        };
        let r = Resolved::from_layers(&[("flag", &fixed)]);
        assert_eq!((r.params.seed, r.origin(Setting::Seed)), (7, "flag"));
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            ..SamplingParams::default()
        });
        for _ in 0..100 {
            let t = s.sample(&logits(&[5.0, 4.9, -5.0, -5.0]), &[]).unwrap();
            assert!(t < 2, "{t}");
        }
    }
}
