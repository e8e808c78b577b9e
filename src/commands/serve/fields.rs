//! What of a request's JSON is read, and what it is counted for before it is read (issue 64): as
//! values JSON takes many times its bytes, so messages, parts and values are counted in passes
//! that make nothing, and only the fields kvchat reads become values.

/// The messages and content parts of a request, counted before its JSON is read into values.
///
/// As values, JSON takes many times its size: 8 MiB of `{"role":"user","content":""}` is 289,260
/// maps, ~250 MB. This pass reads the same bytes into nothing (serde's `IgnoredAny`) and only
/// counts, so a body past the counts is refused at the cost of its bytes alone. A body it cannot
/// read (wrong types, bad JSON) passes on to the full reading, whose errors name the field.
pub mod counted {
    use crate::commands::serve::api::{ApiError, MAX_MESSAGES, MAX_PARTS};
    use serde::de::{Deserializer, IgnoredAny, SeqAccess, Visitor};
    use serde::Deserialize;
    use std::fmt;

    #[derive(Deserialize)]
    struct Request {
        #[serde(default)]
        messages: Messages,
    }

    /// How many messages, and the first with too many content parts (its index, its parts).
    #[derive(Default)]
    struct Messages {
        count: usize,
        over_parts: Option<(usize, usize)>,
    }

    #[derive(Deserialize)]
    struct Message {
        #[serde(default)]
        content: Parts,
    }

    /// A content's parts (0 for a string or null).
    #[derive(Default)]
    struct Parts(usize);

    impl<'de> Deserialize<'de> for Messages {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Counting;
            impl<'de> Visitor<'de> for Counting {
                type Value = Messages;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("an array of messages")
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
                    let mut m = Messages::default();
                    while let Some(msg) = seq.next_element::<Message>()? {
                        if msg.content.0 > MAX_PARTS && m.over_parts.is_none() {
                            m.over_parts = Some((m.count, msg.content.0));
                        }
                        m.count += 1;
                    }
                    Ok(m)
                }
            }
            d.deserialize_seq(Counting)
        }
    }

    impl<'de> Deserialize<'de> for Parts {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Counting;
            impl<'de> Visitor<'de> for Counting {
                type Value = Parts;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a string or an array of parts")
                }
                fn visit_str<E>(self, _: &str) -> Result<Parts, E> {
                    Ok(Parts(0))
                }
                fn visit_unit<E>(self) -> Result<Parts, E> {
                    Ok(Parts(0))
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parts, A::Error> {
                    let mut n = 0;
                    while seq.next_element::<IgnoredAny>()?.is_some() {
                        n += 1;
                    }
                    Ok(Parts(n))
                }
            }
            d.deserialize_any(Counting)
        }
    }

    /// Refuses a request past the counts; anything else passes.
    pub fn check(body: &[u8]) -> Result<(), ApiError> {
        let Ok(Request { messages }) = serde_json::from_slice::<Request>(body) else {
            return Ok(());
        };
        if messages.count > MAX_MESSAGES {
            return Err(ApiError::field(
                "messages",
                format!(
                    "'messages' holds {} messages, more than the {MAX_MESSAGES} kvchat serve takes in one request",
                    messages.count
                ),
            ));
        }
        if let Some((i, parts)) = messages.over_parts {
            let param = format!("messages[{i}]");
            return Err(ApiError::field(
                &param,
                format!(
                    "{param}: {parts} content parts, more than the {MAX_PARTS} kvchat serve takes in one message"
                ),
            ));
        }
        Ok(())
    }
}

/// The fields of a request that kvchat reads, as a tree: what a body holds beside them is read
/// past (serde's `IgnoredAny`) and never becomes a JSON value. As values, JSON takes up to ~30
/// times its bytes, and a flood of large bodies that the server has freed leaves part of that
/// behind in the allocator's per-thread arenas; a field nobody reads costs its bytes alone. A
/// key read anywhere in `api.rs` or `tools.rs` must be listed: each field has a wrong-value case
/// in `each_wrong_field_is_a_400_naming_it` (and the completions' in theirs), which fails for a
/// field left out.
pub mod known {
    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde::Deserialize;
    use serde_json::{Map, Value};
    use std::fmt;

    /// What is kept of a value.
    pub enum Shape {
        /// All of it.
        Any,
        /// An object's listed fields (anything else: all of it, for its reader to refuse).
        Object(&'static [(&'static str, &'static Shape)]),
        /// An array's items, each kept as the shape says (anything else: all of it).
        Array(&'static Shape),
    }

    pub static ANY: Shape = Shape::Any;
    static PART: Shape = Shape::Object(&[("type", &ANY), ("text", &ANY)]);
    static CONTENT: Shape = Shape::Array(&PART);
    static MESSAGE: Shape = Shape::Object(&[
        ("role", &ANY),
        ("content", &CONTENT),
        ("tool_calls", &ANY),
        ("tool_call_id", &ANY),
        ("name", &ANY),
    ]);
    static MESSAGES: Shape = Shape::Array(&MESSAGE);
    pub static REQUEST: Shape = Shape::Object(&[
        ("messages", &MESSAGES),
        ("prompt", &ANY),
        ("max_tokens", &ANY),
        ("max_completion_tokens", &ANY),
        ("temperature", &ANY),
        ("top_p", &ANY),
        ("top_k", &ANY),
        ("min_p", &ANY),
        ("repeat_penalty", &ANY),
        ("frequency_penalty", &ANY),
        ("presence_penalty", &ANY),
        ("seed", &ANY),
        ("stop", &ANY),
        ("stream", &ANY),
        ("stream_options", &ANY),
        ("n", &ANY),
        ("logprobs", &ANY),
        ("top_logprobs", &ANY),
        ("logit_bias", &ANY),
        ("response_format", &ANY),
        ("tools", &ANY),
        ("tool_choice", &ANY),
        ("parallel_tool_calls", &ANY),
        ("functions", &ANY),
        ("echo", &ANY),
        ("suffix", &ANY),
        ("best_of", &ANY),
        ("chat_template_kwargs", &ANY),
        ("reasoning_effort", &ANY),
    ]);

    /// The most JSON values (objects, arrays, strings, numbers, …) a request may hold in the
    /// fields kvchat reads: ~25 MB as values. Counted before any is made.
    pub const MAX_VALUES: u64 = 1 << 18;

    /// How many values the fields kvchat reads hold (None: the body does not read as JSON, for
    /// the full reading to say why).
    pub fn count(body: &[u8], shape: &'static Shape) -> Option<u64> {
        let mut de = serde_json::Deserializer::from_slice(body);
        DeserializeSeed::deserialize(Count(shape), &mut de).ok()
    }

    /// Counts the values a read with [`Keep`] would make, making none.
    struct Count(&'static Shape);

    impl<'de> DeserializeSeed<'de> for Count {
        type Value = u64;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
            d.deserialize_any(Counting(self.0))
        }
    }

    struct Counting(&'static Shape);

    impl<'de> Visitor<'de> for Counting {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<u64, E> {
            Ok(1)
        }
        fn visit_i64<E>(self, _: i64) -> Result<u64, E> {
            Ok(1)
        }
        fn visit_u64<E>(self, _: u64) -> Result<u64, E> {
            Ok(1)
        }
        fn visit_f64<E>(self, _: f64) -> Result<u64, E> {
            Ok(1)
        }
        fn visit_str<E>(self, _: &str) -> Result<u64, E> {
            Ok(1)
        }
        fn visit_unit<E>(self) -> Result<u64, E> {
            Ok(1)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
            let item = match self.0 {
                Shape::Array(item) => *item,
                _ => &ANY,
            };
            let mut n = 1;
            while let Some(k) = seq.next_element_seed(Count(item))? {
                n += k;
            }
            Ok(n)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
            let mut n = 1;
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                let keep = match self.0 {
                    Shape::Object(fields) => fields.iter().find(|(k, _)| *k == key).map(|f| f.1),
                    _ => Some(&ANY),
                };
                match keep {
                    Some(shape) => n += 1 + map.next_value_seed(Count(shape))?,
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(n)
        }
    }

    /// Reads a value, keeping what its shape lists.
    pub struct Keep(pub &'static Shape);

    impl<'de> DeserializeSeed<'de> for Keep {
        type Value = Value;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            match self.0 {
                Shape::Any => Value::deserialize(d),
                shape => d.deserialize_any(Keeping(shape)),
            }
        }
    }

    struct Keeping(&'static Shape);

    impl<'de> Visitor<'de> for Keeping {
        type Value = Value;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_string()))
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_none<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let item = match self.0 {
                Shape::Array(item) => *item,
                _ => &ANY,
            };
            let mut out = Vec::new();
            while let Some(v) = seq.next_element_seed(Keep(item))? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut out = Map::new();
            while let Some(key) = map.next_key::<String>()? {
                let keep = match self.0 {
                    Shape::Object(fields) => fields.iter().find(|(k, _)| *k == key).map(|f| f.1),
                    _ => Some(&ANY),
                };
                match keep {
                    Some(shape) => {
                        out.insert(key, map.next_value_seed(Keep(shape))?);
                    }
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(Value::Object(out))
        }
    }
}
