//! Each token's bytes: the text it stands for, as a grammar engine matches it byte by byte
//! (`crate::grammar`). A control token's bytes are its text after a 0xFF mark, which no text
//! holds (the convention of llguidance's token trie), so that only a grammar naming it allows it.

use super::{spm, Backend, Tokenizer};

/// The mark before a control token's text.
pub const CONTROL_MARK: u8 = 0xff;

impl Tokenizer {
    /// Every token's bytes, by id (`vocab_size` entries).
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        match &self.backend {
            Backend::Hf { inner, .. } => {
                let added = inner.get_added_tokens_decoder();
                let unbyte = byte_level_map();
                (0..self.vocab_size() as u32)
                    .map(|id| {
                        if let Some(t) = added.get(&id) {
                            return marked(&t.content, t.special);
                        }
                        let text = inner.id_to_token(id).unwrap_or_default();
                        // Byte-level BPE spells each byte as one character; a tokenizer.json of
                        // another kind spells text as it is, "▁" for a space, "<0xNN>" for a byte.
                        text.chars()
                            .map(|c| unbyte.get(&c).copied())
                            .collect::<Option<Vec<u8>>>()
                            .unwrap_or_else(|| sentencepiece_bytes(&text, spm::NORMAL))
                    })
                    .collect()
            }
            Backend::Spm(s) => {
                let (texts, _, types) = s.vocabulary();
                texts
                    .iter()
                    .zip(types)
                    .map(|(t, &ty)| match ty {
                        spm::CONTROL | spm::UNKNOWN => marked(t, true),
                        _ => sentencepiece_bytes(t, ty),
                    })
                    .collect()
            }
        }
    }
}

fn marked(text: &str, control: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(text.len() + 1);
    if control {
        b.push(CONTROL_MARK);
    }
    b.extend_from_slice(text.as_bytes());
    b
}

/// A SentencePiece token's bytes: "<0xNN>" is the byte NN, "▁" a space.
fn sentencepiece_bytes(text: &str, ty: u8) -> Vec<u8> {
    if let Some(hex) = text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
        if let (2, Ok(b)) = (hex.len(), u8::from_str_radix(hex, 16)) {
            if ty == spm::BYTE || ty == spm::NORMAL {
                return vec![b];
            }
        }
    }
    text.replace('\u{2581}', " ").into_bytes()
}

/// GPT-2's byte-level alphabet read back: the character each byte is spelled as → the byte.
/// Printable bytes stand for themselves; the others are 256, 257, … in byte order.
fn byte_level_map() -> std::collections::HashMap<char, u8> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = b as char;
            let printable = matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
            if printable {
                (c, b)
            } else {
                let spelled = char::from_u32(next).expect("below 0x200 is a char");
                next += 1;
                (spelled, b)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_alphabet_spells_a_space_as_g_with_a_dot_and_a_newline_as_c_with_a_dot() {
        let m = byte_level_map();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'a'], b'a');
    }

    #[test]
    fn a_sentencepiece_byte_token_is_its_byte_and_a_word_has_its_space() {
        assert_eq!(sentencepiece_bytes("<0x0A>", spm::BYTE), vec![b'\n']);
        assert_eq!(sentencepiece_bytes("\u{2581}Hello", spm::NORMAL), b" Hello");
        assert_eq!(marked("<eos>", true), b"\xff<eos>");
    }
}
