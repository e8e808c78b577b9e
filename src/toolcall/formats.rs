//! The tool-call formats, one row per model family: how a model of that family writes a call, and
//! how its chat template shows it is one. A new family is one row here (and its reader, if no
//! existing one fits).

use super::grammar::{lark_json, parameters, Parts, Rules};
use super::Call;
use serde_json::Value;

/// How one family writes its calls.
#[derive(Debug)]
pub struct Format {
    pub name: &'static str,
    /// Whether a chat template's source is this family's (rows are tried in order).
    detect: fn(&str) -> bool,
    /// The text that opens a call, or the list of calls.
    pub open: &'static str,
    /// The text that closes it; empty: the end of the answer.
    pub close: &'static str,
    /// Whether calls may only open the answer (text first means no call).
    pub at_start: bool,
    /// Whether an answer may also be its calls as bare JSON objects, `{"name": …}`, without the
    /// opening (as small Qwen models write them; llama.cpp's Hermes reader takes them too).
    pub bare_json: bool,
    /// Reads the calls between `open` and `close`.
    pub read: fn(&str) -> Result<Vec<Call>, String>,
    /// Its calls as a grammar (`grammar.rs`), for constrained decoding.
    pub grammar: fn(&Parts) -> Option<Rules>,
}

/// The table. Qwen3-Coder's XML before Hermes (both open with `<tool_call>`).
pub const FORMATS: &[Format] = &[
    // gpt-oss: its answers are read by channels (`harmony::Channels`), calls among them.
    Format {
        name: "harmony",
        detect: super::harmony::is_harmony,
        open: "to=functions.",
        close: "",
        at_start: false,
        bare_json: false,
        read: super::harmony::read,
        grammar: harmony_rules,
    },
    Format {
        name: "functiongemma",
        detect: |t| t.contains("<start_function_call>"),
        open: "<start_function_call>",
        close: "<end_function_call>",
        at_start: false,
        bare_json: false,
        read: |t| super::gemma::read(t, super::gemma::ESCAPE),
        grammar: |p| {
            super::gemma::rules(
                p,
                "<start_function_call>",
                "<end_function_call>",
                super::gemma::ESCAPE,
            )
        },
    },
    Format {
        name: "gemma4",
        detect: |t| t.contains("<|tool_call>"),
        open: "<|tool_call>",
        close: "<tool_call|>",
        at_start: false,
        bare_json: false,
        read: |t| super::gemma::read(t, super::gemma::QUOTE),
        grammar: |p| super::gemma::rules(p, "<|tool_call>", "<tool_call|>", super::gemma::QUOTE),
    },
    Format {
        name: "qwen3-coder-xml",
        detect: |t| t.contains("<tool_call>") && t.contains("<function="),
        open: "<tool_call>",
        close: "</tool_call>",
        at_start: false,
        bare_json: false,
        read: read_xml_function,
        grammar: xml_rules,
    },
    Format {
        name: "hermes",
        detect: |t| t.contains("<tool_call>"),
        open: "<tool_call>",
        close: "</tool_call>",
        at_start: false,
        bare_json: true,
        read: read_json_calls,
        grammar: hermes_rules,
    },
    Format {
        name: "mistral",
        detect: |t| t.contains("[TOOL_CALLS]"),
        open: "[TOOL_CALLS]",
        close: "",
        at_start: false,
        bare_json: false,
        read: read_json_calls,
        grammar: mistral_rules,
    },
    Format {
        name: "llama3-json",
        detect: |t| t.contains("<|start_header_id|>") && t.contains("tools"),
        open: "{",
        close: "",
        at_start: true,
        bare_json: false,
        read: read_brace_json_calls,
        grammar: llama3_rules,
    },
];

/// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one per call, a newline between.
fn hermes_rules(p: &Parts) -> Option<Rules> {
    let after = format!(
        "\"\\n\" {} \"\\n\" {}",
        p.call_json(),
        (p.term)("</tool_call>")
    );
    let one = format!("{} {after}", (p.term)("<tool_call>"));
    Some(Rules {
        calls: p.repeated(&one, "\"\\n\""),
        after_open: Some(after),
    })
}

/// Harmony's: an optional analysis message, then one call on the commentary channel, ended by
/// `<|call|>` (which ends the answer).
fn harmony_rules(p: &Parts) -> Option<Rules> {
    let t = p.term;
    let call = |tool: &&crate::toolcall::Tool| {
        format!(
            "{} \"commentary to=functions.{} \" {} \"json\" {} {} {}",
            t("<|channel|>"),
            tool.name,
            t("<|constrain|>"),
            t("<|message|>"),
            lark_json(&parameters(tool)),
            t("<|call|>")
        )
    };
    let analysis = format!(
        "({} \"analysis\" {} /[^<]*/ {} {} \"assistant\")?",
        t("<|channel|>"),
        t("<|message|>"),
        t("<|end|>"),
        t("<|start|>")
    );
    let calls: Vec<String> = p.tools.iter().map(call).collect();
    Some(Rules {
        calls: format!("{analysis} ({})", calls.join(" | ")),
        after_open: None,
    })
}

/// `[TOOL_CALLS]` then a JSON list of call objects.
fn mistral_rules(p: &Parts) -> Option<Rules> {
    let after = p.call_list_json();
    Some(Rules {
        calls: format!("{} {after}", (p.term)("[TOOL_CALLS]")),
        after_open: Some(after),
    })
}

/// The answer is one call object (its brace is the opening: no lazy grammar).
fn llama3_rules(p: &Parts) -> Option<Rules> {
    Some(Rules {
        calls: p.call_json(),
        after_open: None,
    })
}

/// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…</function>\n</tool_call>`:
/// the parameters in the schema's order, the required ones always; a string value is text
/// without `<`, any other a JSON value of its schema.
fn xml_rules(p: &Parts) -> Option<Rules> {
    let t = p.term;
    let function = |tool: &&crate::toolcall::Tool| -> Option<String> {
        let schema = parameters(tool);
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = format!("{} ", t(&format!("<function={}>\n", tool.name)));
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (key, s) in props {
                let value = match s.get("type").and_then(Value::as_str) {
                    Some("string") if s.get("enum").is_none() => "/[^<]+/".to_string(),
                    _ => lark_json(s),
                };
                let param = format!(
                    "({} {value} {})",
                    t(&format!("<parameter={key}>\n")),
                    t("\n</parameter>\n")
                );
                body.push_str(&param);
                body.push_str(if required.contains(&key.as_str()) {
                    " "
                } else {
                    "? "
                });
            }
        }
        body.push_str(&t("</function>\n"));
        Some(format!("({body})"))
    };
    let functions = p.tools.iter().map(function).collect::<Option<Vec<_>>>()?;
    let after = format!("\"\\n\" ({}) {}", functions.join(" | "), t("</tool_call>"));
    let one = format!("{} {after}", t("<tool_call>"));
    Some(Rules {
        calls: p.repeated(&one, "\"\\n\""),
        after_open: Some(after),
    })
}

/// The format a chat template's model writes calls in, if kvchat knows it.
pub fn for_template(source: &str) -> Option<&'static Format> {
    FORMATS.iter().find(|f| (f.detect)(source))
}

/// A call object: `{"name": …, "arguments": {…}}` (Llama's `parameters` too; arguments given as a
/// JSON string are read as the object they hold).
fn call_of(v: &Value) -> Result<Call, String> {
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or("a call without a 'name' string")?;
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str(s)
            .map_err(|e| format!("the arguments of '{name}' are not JSON: {e}"))?,
        Some(a) => a.clone(),
    };
    if !arguments.is_object() {
        return Err(format!("the arguments of '{name}' are not a JSON object"));
    }
    Ok(Call {
        name: name.to_string(),
        arguments,
    })
}

/// One call object, or a list of them.
fn read_json_calls(text: &str) -> Result<Vec<Call>, String> {
    let v: Value = serde_json::from_str(text.trim()).map_err(|e| format!("not JSON: {e}"))?;
    match &v {
        Value::Array(calls) => calls.iter().map(call_of).collect(),
        _ => Ok(vec![call_of(&v)?]),
    }
}

/// Calls as bare JSON objects, one after another (whitespace between).
pub fn read_bare_json_calls(text: &str) -> Result<Vec<Call>, String> {
    let values: Vec<Value> = serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("not JSON: {e}"))?;
    if values.is_empty() {
        return Err("no call".into());
    }
    values.iter().map(call_of).collect()
}

/// Llama 3's: the answer is the call object (its opening brace was the marker), or several
/// separated by `;`.
fn read_brace_json_calls(text: &str) -> Result<Vec<Call>, String> {
    let whole = format!("{{{text}");
    match read_json_calls(&whole) {
        Ok(calls) => Ok(calls),
        Err(e) => {
            let parts: Vec<&str> = whole.split(';').filter(|p| !p.trim().is_empty()).collect();
            if parts.len() < 2 {
                return Err(e);
            }
            parts
                .into_iter()
                .map(|p| read_json_calls(p).and_then(|mut c| c.pop().ok_or_else(|| e.clone())))
                .collect()
        }
    }
}

/// Qwen3-Coder's: `<function=NAME>` then `<parameter=KEY>VALUE</parameter>`s, `</function>`. A
/// value that reads as JSON (a number, an object, `true`) is that value; anything else is text.
fn read_xml_function(text: &str) -> Result<Vec<Call>, String> {
    let body = text.trim();
    let rest = body
        .strip_prefix("<function=")
        .ok_or("a call that does not start with <function=NAME>")?;
    let (name, mut rest) = rest.split_once('>').ok_or("an unclosed <function=")?;
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return Err("text after </function>".into());
            }
            break;
        }
        let p = rest
            .strip_prefix("<parameter=")
            .ok_or("expected <parameter=KEY> or </function>")?;
        let (key, p) = p.split_once('>').ok_or("an unclosed <parameter=")?;
        let (value, p) = p
            .split_once("</parameter>")
            .ok_or("a parameter without </parameter>")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let parsed = serde_json::from_str::<Value>(value)
            .ok()
            .filter(|v| !v.is_string())
            .unwrap_or_else(|| Value::String(value.to_string()));
        arguments.insert(key.to_string(), parsed);
        rest = p;
    }
    Ok(vec![Call {
        name: name.trim().to_string(),
        arguments: Value::Object(arguments),
    }])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(name: &str) -> &'static Format {
        FORMATS.iter().find(|f| f.name == name).unwrap()
    }

    #[test]
    fn each_family_is_found_from_its_template() {
        let qwen25 = "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>";
        let coder = "<tool_call>\n<function=example_function_name>\n<parameter=p>";
        let mistral = "{%- if message.tool_calls %}[TOOL_CALLS][";
        let llama = "<|start_header_id|>ipython<|end_header_id|> {%- if tools is not none %}";
        assert_eq!(for_template(qwen25).unwrap().name, "hermes");
        assert_eq!(for_template(coder).unwrap().name, "qwen3-coder-xml");
        assert_eq!(for_template(mistral).unwrap().name, "mistral");
        assert_eq!(for_template(llama).unwrap().name, "llama3-json");
        let gpt_oss = "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|return|>";
        assert_eq!(for_template(gpt_oss).unwrap().name, "harmony");
        let function_gemma = "{{ '<start_function_call>call:' + name }}";
        assert_eq!(for_template(function_gemma).unwrap().name, "functiongemma");
        let gemma4 = "{{ '<|tool_call>call:' + name }}{{ '<tool_call|>' }}";
        assert_eq!(for_template(gemma4).unwrap().name, "gemma4");
        assert!(for_template("{{ messages[0].content }}").is_none());
    }

    #[test]
    fn hermes_reads_a_call_with_arguments_as_an_object_or_a_string() {
        let read = row("hermes").read;
        let calls =
            read("\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n").unwrap();
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
        let calls = read(r#"{"name": "f", "arguments": "{\"x\": 1}"}"#).unwrap();
        assert_eq!(calls[0].arguments, json!({"x": 1}));
    }

    #[test]
    fn a_call_without_a_name_or_with_arguments_that_are_not_an_object_is_refused() {
        let read = row("hermes").read;
        assert!(read(r#"{"arguments": {}}"#).is_err());
        assert!(read(r#"{"name": "f", "arguments": [1]}"#).is_err());
        assert!(read(r#"{"name": "f", "arguments": {"#).is_err());
    }

    #[test]
    fn bare_calls_are_read_one_after_another() {
        let calls = read_bare_json_calls(
            "{\"name\": \"a\", \"arguments\": {}}\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}",
        )
        .unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, json!({"x": 1}));
        assert!(read_bare_json_calls("{\"name\": \"a\"} trailing").is_err());
    }

    #[test]
    fn mistral_reads_its_list_of_calls() {
        let calls = (row("mistral").read)(
            r#"[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]"#,
        )
        .unwrap();
        let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn llama3_reads_parameters_after_its_opening_brace_and_calls_separated_by_semicolons() {
        let read = row("llama3-json").read;
        let calls = read(r#""name": "f", "parameters": {"q": "x"}}"#).unwrap();
        assert_eq!(calls[0].arguments, json!({"q": "x"}));
        let calls =
            read(r#""name": "f", "parameters": {}}; {"name": "g", "parameters": {}}"#).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].name, "g");
    }

    #[test]
    fn qwen3_coder_reads_parameters_as_json_where_they_are_and_text_otherwise() {
        let text = "\n<function=search>\n<parameter=query>\nrust borrow checker\n</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=opts>\n{\"a\": true}\n</parameter>\n</function>\n";
        let calls = (row("qwen3-coder-xml").read)(text).unwrap();
        assert_eq!(calls[0].name, "search");
        assert_eq!(
            calls[0].arguments,
            json!({"query": "rust borrow checker", "limit": 5, "opts": {"a": true}})
        );
        assert!((row("qwen3-coder-xml").read)("<function=f>\n<parameter=x>1").is_err());
    }
}
