//! A chat conversation over one KV cache. Each turn renders the whole conversation with the model's
//! template, keeps the longest token prefix the cache already holds, and prefills only the rest — so a
//! conversation never pays twice for the same tokens, and if a template re-renders earlier turns
//! differently, the cache goes back to the common prefix instead of attending over stale tokens.

use super::prefix::PrefixReuse;
use super::{GenStats, Sampler, Session, StopReason};
use crate::engine::Engine;
use crate::kv::CacheSpec;
use crate::template::{ChatTemplate, Message};
use crate::tokenizer::Length;
use crate::tokenizer::TextStream;
use anyhow::{bail, Result};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// What to do when the conversation no longer fits the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFull {
    /// Refuse the turn with a message.
    Stop,
    /// Drop the oldest whole turns (the system prompt stays) and re-prefill what remains.
    Shift,
    /// Have the model summarise the oldest turns into a note that joins the system message
    /// ([`Conversation::compact`]), and re-prefill what remains.
    Compact,
}

impl std::str::FromStr for OnFull {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "stop" => Ok(OnFull::Stop),
            "shift" => Ok(OnFull::Shift),
            "compact" => Ok(OnFull::Compact),
            other => bail!("'{other}' is not stop, shift or compact"),
        }
    }
}

/// What one turn did.
#[derive(Debug, Clone)]
pub struct TurnStats {
    /// Which turn of the conversation this was (1 = the first), counting turns shifted out.
    pub number: usize,
    /// Positions reused from the cache.
    pub reused: usize,
    /// Positions prefilled this turn.
    pub prefilled: usize,
    /// Turns dropped to make room ([`OnFull::Shift`]).
    pub shifted: usize,
    pub gen: GenStats,
    pub reason: StopReason,
    /// The prefix store's lookup, when this turn made one.
    pub store: Option<super::prefix::Lookup>,
    /// Compactions made to fit this turn ([`OnFull::Compact`]).
    pub compacted: Vec<Compaction>,
}

/// What one compaction did: `turns` of the oldest exchanges summarised into the note, and the
/// conversation's length as rendered before and after, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compaction {
    pub turns: usize,
    pub tokens_before: usize,
    pub tokens_after: usize,
    pub note_tokens: usize,
}

impl std::fmt::Display for Compaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "compacted {} turn{} into a note of {} tokens: the conversation went from {} to {} tokens",
            self.turns,
            if self.turns == 1 { "" } else { "s" },
            self.note_tokens,
            self.tokens_before,
            self.tokens_after
        )
    }
}

/// The most tokens a compaction's note may take (a quarter of a smaller context).
pub const NOTE_TOKENS: usize = 160;
/// What the model is asked when it compacts turns.
const SUMMARY_ASK: &str =
    "Summarize the conversation below in a few sentences, for your own later \
reference. Keep every name, number, fact, request and decision; leave out greetings.";
/// How the note joins the system message.
const NOTE_HEAD: &str = "Summary of the earlier conversation: ";

/// A conversation: its messages and the session whose cache holds them, changed together (asking,
/// undoing, resetting, loading), so the cache never holds tokens the messages no longer render.
pub struct Conversation<'e> {
    engine: &'e Engine,
    template: ChatTemplate,
    system: Option<String>,
    /// (user, assistant) exchanges, oldest first.
    turns: Vec<(String, String)>,
    session: Session<'e>,
    on_full: OnFull,
    last: Option<TurnStats>,
    /// Turns shifted out by [`OnFull::Shift`] or compacted so far (turn numbers keep counting them).
    shifted_out: usize,
    /// The model's summary of the turns compacted so far, part of the system message.
    note: Option<String>,
    /// The prefix store: looked up when the session holds nothing of the conversation (its
    /// first turn, after /reset), and given each prompt's new blocks once its answer is out.
    store: PrefixReuse,
    /// Speculative decoding of the answers, when asked for (see `Session::decode_drafted`).
    drafter: Option<Box<dyn super::draft::Drafter + 'e>>,
}

impl<'e> Conversation<'e> {
    pub fn new(
        engine: &'e Engine,
        spec: &CacheSpec,
        template: ChatTemplate,
        system: Option<String>,
        on_full: OnFull,
    ) -> Self {
        Self {
            engine,
            template,
            system,
            turns: Vec::new(),
            session: engine.session(spec),
            on_full,
            last: None,
            shifted_out: 0,
            note: None,
            store: PrefixReuse::off("not opened"),
            drafter: None,
        }
    }

    /// Drafts up to `max` tokens a forward by prompt lookup from now on (None: no drafting).
    pub fn set_draft(&mut self, max: Option<usize>) {
        self.set_drafter(
            max.map(|m| {
                Box::new(super::draft::Ngram::new(m)) as Box<dyn super::draft::Drafter + 'e>
            }),
        );
    }

    /// Drafts with `drafter` from now on (a draft model's, prompt lookup; None: no drafting).
    pub fn set_drafter(&mut self, drafter: Option<Box<dyn super::draft::Drafter + 'e>>) {
        self.drafter = drafter;
    }

    pub fn engine(&self) -> &'e Engine {
        self.engine
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// What happens when a turn no longer fits the context.
    pub fn on_full(&self) -> OnFull {
        self.on_full
    }

    /// The session whose cache holds the conversation.
    pub fn session(&self) -> &Session<'e> {
        &self.session
    }

    /// The session, to feed tokens past the conversation (what the next turn reuses is what it
    /// still shares with the rendered conversation).
    pub fn session_mut(&mut self) -> &mut Session<'e> {
        &mut self.session
    }

    pub fn system(&self) -> Option<&str> {
        self.system.as_deref()
    }

    /// Sets the system message; the next turn renders with it (and reuses what still matches).
    pub fn set_system(&mut self, system: Option<String>) {
        self.system = system;
    }

    /// The (user, assistant) exchanges, oldest first.
    pub fn turns(&self) -> &[(String, String)] {
        &self.turns
    }

    /// Adds an exchange that happened elsewhere (a transcript): the next turn renders it before
    /// its question.
    pub fn record_exchange(&mut self, user: &str, assistant: &str) {
        self.turns.push((user.to_string(), assistant.to_string()));
    }

    /// What the last turn did.
    pub fn last(&self) -> Option<&TurnStats> {
        self.last.as_ref()
    }

    pub fn store(&self) -> &PrefixReuse {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut PrefixReuse {
        &mut self.store
    }

    /// Uses `store` for the prefix store from now on.
    pub fn set_store(&mut self, store: PrefixReuse) {
        self.store = store;
    }

    /// The note that summarises the compacted turns, if any were.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    pub fn messages(&self, pending: Option<&str>) -> Vec<Message> {
        let mut m = Vec::new();
        let system = match (&self.system, &self.note) {
            (Some(s), Some(n)) => Some(format!("{s}\n\n{NOTE_HEAD}{n}")),
            (None, Some(n)) => Some(format!("{NOTE_HEAD}{n}")),
            (s, None) => s.clone(),
        };
        if let Some(s) = &system {
            m.push(Message::new("system", s));
        }
        for (u, a) in &self.turns {
            m.push(Message::new("user", u));
            m.push(Message::new("assistant", a));
        }
        if let Some(q) = pending {
            m.push(Message::new("user", q));
        }
        m
    }

    /// Token ids of the conversation (plus a pending question) rendered by the template; with
    /// `answer` the text ends where the assistant speaks.
    pub fn render_ids(&self, pending: Option<&str>, answer: bool) -> Result<Vec<u32>> {
        let messages = self.messages(pending);
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        self.engine
            .encode_conversation(&self.template, &messages, answer)
    }

    /// The conversation with `question`, rendered for an answer, as ids when it is shorter than
    /// `limit` tokens; else its length — found from its bytes alone when they show it, before
    /// tokenizing (which takes ~180 bytes of memory per byte of text).
    fn render_within(&self, question: &str, limit: usize) -> Result<Result<Vec<u32>, Length>> {
        let messages = self.messages(Some(question));
        let text = self.template.render(&messages, true)?;
        let at_least = self.engine.tokenizer().min_tokens(text.len());
        if at_least >= limit {
            return Ok(Err(Length::AtLeast(at_least, text.len())));
        }
        let ids = self.engine.encode_rendered(&text, &messages)?;
        if ids.len() >= limit {
            return Ok(Err(Length::Counted(ids.len())));
        }
        Ok(Ok(ids))
    }

    fn length(&self, text: &str, limit: usize) -> Result<Length> {
        self.engine.tokenizer().length_within(text, limit)
    }

    /// Why a conversation of no earlier turns (`whole` long) does not fit `limit`: the system
    /// message alone, the question alone, or the two together.
    fn does_not_fit(&self, question: &str, whole: Length, limit: usize) -> Result<anyhow::Error> {
        let system = match &self.system {
            Some(s) => Some(self.length(s, limit)?),
            None => None,
        };
        let why = match system {
            Some(s) if s.tokens() >= limit => {
                format!("the system message is {s}, more than the context of {limit}")
            }
            _ => {
                let q = self.length(question, limit)?;
                match system {
                    _ if q.tokens() >= limit => {
                        format!("the question is {q}, more than the context of {limit}")
                    }
                    Some(s) => format!(
                        "the system message ({s}) and the question ({q}) are {whole} in the chat template, more than the context of {limit}"
                    ),
                    None => format!(
                        "the question ({q}) is {whole} in the chat template, more than the context of {limit}"
                    ),
                }
            }
        };
        Ok(crate::fixable(crate::Fix::RaiseContext, why))
    }

    /// Refuses a system message that alone fills `limit` positions (before any turn is asked).
    pub fn check_system(&self) -> Result<()> {
        let limit = self.session.max_positions();
        if let Some(s) = &self.system {
            let n = self.length(s, limit)?;
            if n.tokens() >= limit {
                return Err(crate::fixable(
                    crate::Fix::RaiseContext,
                    format!("the system message is {n}, more than the context of {limit}"),
                ));
            }
        }
        Ok(())
    }

    /// Asks `question`; `on_text` gets the answer as it streams. Generation stops early when
    /// `interrupt` is set (the partial answer stays as the assistant's turn).
    pub fn ask(
        &mut self,
        question: &str,
        sampler: &mut Sampler,
        max_tokens: usize,
        interrupt: &AtomicBool,
        mut on_text: impl FnMut(&str) -> Result<()>,
    ) -> Result<TurnStats> {
        if question.trim().is_empty() {
            bail!("the question is empty");
        }
        let limit = self.session.max_positions();
        // A question whose bytes alone cannot fit is refused before it is rendered or tokenized.
        self.engine
            .refuse_by_bytes("the question", question, limit)?;
        let mut shifted = 0;
        let mut compacted = Vec::new();
        let ids = loop {
            let whole = match self.render_within(question, limit)? {
                Ok(ids) => break ids,
                Err(whole) => whole,
            };
            if self.turns.is_empty() {
                // A note that no longer leaves room goes before the question is refused.
                if self.on_full == OnFull::Compact && self.note.take().is_some() {
                    continue;
                }
                return Err(self.does_not_fit(question, whole, limit)?);
            }
            match self.on_full {
                OnFull::Stop => {
                    return Err(crate::fixable(
                        crate::Fix::ChatFull,
                        format!(
                            "the conversation is {whole} and no longer fits the context of {limit}"
                        ),
                    ))
                }
                OnFull::Shift => {
                    self.turns.remove(0);
                    self.shifted_out += 1;
                    shifted += 1;
                }
                OnFull::Compact => compacted.push(self.compact()?),
            }
        };
        let mut reused = self.session.keep_prefix_of(&ids)?;
        // Nothing of the conversation in the cache: the store may hold its start, and what is
        // prefilled now is one prefill (see session::prefix).
        let fresh = reused == 0;
        let messages = self.messages(Some(question));
        // Where the first message ends (the system prompt): the store may end a block there.
        let boundaries = self.engine.message_boundaries(
            &self.template,
            &messages[..messages.len().min(2)],
            &ids,
        );
        let mut lookup = None;
        if fresh && self.store.is_on() {
            reused = self.store.restore(&mut self.session, &ids, &boundaries)?;
            lookup = self.store.last;
        }
        let new = ids.len() - reused;
        let engine = self.engine;
        // A Harmony model's (gpt-oss) channels are written in control tokens: its text keeps them
        // for the reader, and its turn keeps only its answer.
        let harmony = crate::toolcall::harmony::is_harmony(self.template.source());
        let mut stream = match harmony {
            true => TextStream::keeping_special(),
            false => TextStream::new(),
        };
        interrupt.store(false, Ordering::SeqCst);
        // The answer may take what is left of the context, if that is less than max_tokens.
        let room = limit.saturating_sub(ids.len());
        let t0 = std::time::Instant::now();
        // A budget compresses the prompt once it is prefilled: its whole rows are stored first.
        let hold = self.session.evicts_by_score() && self.store.is_on();
        self.session.hold_evictions(hold);
        // (A model with recurrent states snapshots them where the store, /save or /undo may
        // resume.)
        let logits = self.session.prefill(&ids, reused, &boundaries, true)?;
        let prefill = t0.elapsed();
        if hold {
            self.store
                .store(&self.session, fresh, &boundaries, ids.len());
            self.session.evict_held()?;
        }
        let (out, mut reason, mut gen) = self.session.decode_drafted(
            logits,
            sampler,
            max_tokens.min(room).max(1),
            engine.stop_ids(),
            false,
            self.drafter.as_deref_mut(),
            |id| {
                if let Some(t) = stream.push(engine.tokenizer(), id)? {
                    on_text(&t)?;
                }
                Ok(!interrupt.load(Ordering::SeqCst))
            },
        )?;
        gen.prompt_tokens = new;
        gen.prefill = prefill;
        // The prompt's new blocks go to the store while the person reads the answer (not beside
        // the decode, whose threads would lose a core to the writer). Positions the answer added
        // are after the prompt's: the prompt's rows are as the prefill left them.
        if !hold {
            self.store
                .store(&self.session, fresh, &boundaries, ids.len());
        }
        if let Some(t) = stream.finish(engine.tokenizer())? {
            on_text(&t)?;
        }
        if reason == StopReason::MaxTokens && room < max_tokens {
            reason = StopReason::ContextFull;
        }
        let answer = match harmony {
            true => crate::toolcall::harmony::final_text(&engine.tokenizer().decode(&out, false)?),
            false => engine.tokenizer().decode(&out, true)?,
        };
        self.turns.push((question.to_string(), answer));
        let stats = TurnStats {
            number: self.shifted_out + self.turns.len(),
            reused,
            prefilled: new,
            shifted,
            gen,
            reason,
            store: lookup,
            compacted,
        };
        self.last = Some(stats.clone());
        Ok(stats)
    }

    /// Drops the last exchange and truncates the cache to the conversation that remains — the
    /// system prompt's positions included when no exchange remains (rendered with a placeholder
    /// question, so that a template's default system prompt is kept too).
    pub fn undo(&mut self) -> Result<bool> {
        if self.turns.pop().is_none() {
            return Ok(false);
        }
        let ids = self.render_ids(Some("x"), true)?;
        self.session.keep_common_prefix(&ids)?;
        Ok(true)
    }

    /// Has the model summarise the oldest half of the exchanges (at least one), with the note of
    /// earlier compactions, into a new note that joins the system message; the conversation goes
    /// on from the system message, the note and the recent turns. The summary is generated
    /// greedily in this session's cache, which is then emptied (the next turn prefills what
    /// remains; the prefix store, when on, gives back the system message's blocks).
    pub fn compact(&mut self) -> Result<Compaction> {
        if self.turns.is_empty() {
            bail!("there is nothing to compact yet: the conversation has no turns");
        }
        let n = self.turns.len().div_ceil(2);
        let before = self.render_ids(None, false)?.len();
        let mut transcript = String::new();
        if let Some(note) = &self.note {
            transcript += &format!("(Earlier: {note})\n\n");
        }
        for (u, a) in &self.turns[..n] {
            transcript += &format!("User: {u}\nAssistant: {a}\n\n");
        }
        let note = self.summarize(transcript.trim_end())?;
        let note_tokens = self.engine.tokenizer().encode(&note)?.len();
        self.turns.drain(..n);
        self.shifted_out += n;
        self.note = (!note.is_empty()).then_some(note);
        let after = self.render_ids(None, false)?.len();
        Ok(Compaction {
            turns: n,
            tokens_before: before,
            tokens_after: after,
            note_tokens,
        })
    }

    /// The model's greedy summary of `transcript` (its newest part, if the whole does not fit
    /// the context with room for the note), at most [`NOTE_TOKENS`] tokens.
    fn summarize(&mut self, transcript: &str) -> Result<String> {
        // A small context gives the note a quarter of it.
        let note_max = NOTE_TOKENS.min(self.engine.ctx() / 4).max(1);
        let room = self.engine.ctx().saturating_sub(note_max + 1);
        let mut text = transcript;
        let ids = loop {
            let m = [Message::new("user", &format!("{SUMMARY_ASK}\n\n{text}"))];
            let ids = self.engine.chat_prompt(&self.template, &m)?;
            if ids.len() <= room {
                break ids;
            }
            if text.len() < 64 {
                bail!(
                    "the request to summarise the conversation does not fit the context of {}",
                    self.engine.ctx()
                );
            }
            // Keep the newer half.
            let mut at = text.len() / 2;
            while !text.is_char_boundary(at) {
                at += 1;
            }
            text = &text[at..];
        };
        self.session.reset()?;
        let logits = self.session.feed(&ids)?;
        let mut sampler = super::Sampler::new(super::SamplingParams::greedy());
        let (out, _, _) = self.session.decode(
            logits,
            &mut sampler,
            note_max,
            self.engine.stop_ids(),
            false,
            |_| Ok(true),
        )?;
        self.session.reset()?;
        Ok(self
            .engine
            .tokenizer()
            .decode(&out, true)?
            .trim()
            .to_string())
    }

    /// The number the next turn will have.
    pub fn next_turn(&self) -> usize {
        self.shifted_out + self.turns.len() + 1
    }

    pub fn reset(&mut self) -> Result<()> {
        self.turns.clear();
        self.session.reset()?;
        self.last = None;
        self.shifted_out = 0;
        self.note = None;
        Ok(())
    }

    /// Saves the conversation and its KV state.
    pub fn save(&self, path: &Path) -> Result<()> {
        let extra =
            serde_json::json!({ "system": self.system, "turns": self.turns, "note": self.note });
        self.session.save_state(path, self.engine.digest(), extra)
    }

    /// Replaces the conversation and the cache by a saved one (same model and cache configuration).
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let key = self.session.cache().persist_key()?;
        let snap = crate::kv::persist::load(
            path,
            &self.session.persist_expect(self.engine.digest(), &key),
        )?;
        let system: Option<String> =
            serde_json::from_value(snap.extra["system"].clone()).unwrap_or(None);
        let turns: Vec<(String, String)> = serde_json::from_value(snap.extra["turns"].clone())
            .map_err(|_| anyhow::anyhow!("{} holds no conversation", path.display()))?;
        // (Files from before compaction have no note.)
        let note: Option<String> =
            serde_json::from_value(snap.extra["note"].clone()).map_err(|_| {
                anyhow::anyhow!(
                    "{} holds a note of compacted turns that is not text",
                    path.display()
                )
            })?;
        self.session.restore(&snap)?;
        self.system = system;
        self.turns = turns;
        self.note = note;
        self.last = None;
        self.shifted_out = 0;
        Ok(())
    }
}
