//! How the library tells a person something that is not an error — a context lowered to fit
//! memory, a file fetched, a source skipped — without printing: it hands the text to the
//! [`Notes`] sink the front end installed (the binary's writes to stderr), and drops it when none
//! is installed (a library user, a test).

use std::sync::OnceLock;

/// Where notes go.
pub trait Notes: Send + Sync {
    /// A note: one line, no trailing newline.
    fn note(&self, text: &str);
}

static SINK: OnceLock<Box<dyn Notes>> = OnceLock::new();

/// Installs the sink for the whole process; the first one installed stays.
pub fn install(sink: Box<dyn Notes>) {
    let _ = SINK.set(sink);
}

/// Hands `text` to the installed sink, if any.
pub fn note(text: impl AsRef<str>) {
    if let Some(s) = SINK.get() {
        s.note(text.as_ref());
    }
}

/// The binary's sink: each note on its own line of stderr.
pub struct Stderr;

impl Notes for Stderr {
    fn note(&self, text: &str) {
        eprintln!("{text}");
    }
}
