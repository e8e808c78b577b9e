//! A guard for third-party code that can panic on malformed input (candle's GGUF header reader
//! divides by the file's alignment unchecked): the panic becomes an error that the caller words.

/// Runs `f`; a panic inside it is returned as its message instead of ending the process, and the
/// default panic report is not printed for it.
pub fn no_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(previous);
    result.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "malformed input".into())
    })
}
