//! Writes a GGUF model out in the Hugging Face layout (f32 safetensors, config.json, tokenizer.json,
//! tokenizer_config.json): `cargo run --release --example gguf_to_hf -- IN.gguf OUT_DIR`.
//! Used by scripts/make-hf-fixture.sh; the tests call the same library function.

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, out] = args.as_slice() else {
        anyhow::bail!("usage: gguf_to_hf IN.gguf OUT_DIR");
    };
    kvchat::model::export::gguf_to_hf(input.as_ref(), out.as_ref())?;
    println!("{out}");
    Ok(())
}
