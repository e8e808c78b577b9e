"""The tokenizer of one GGUF file written into another: shared by the scripts that write test
models with a real model's tokenizer (write-random-llama.py, widen-smollm2.py)."""
import gguf


def copy_tokenizer(r: gguf.GGUFReader, w: gguf.GGUFWriter) -> None:
    """Every `tokenizer.*` field of `r` added to `w`."""
    add = {
        gguf.GGUFValueType.ARRAY: w.add_array,
        gguf.GGUFValueType.STRING: w.add_string,
        gguf.GGUFValueType.BOOL: w.add_bool,
        gguf.GGUFValueType.UINT32: w.add_uint32,
        gguf.GGUFValueType.INT32: w.add_int32,
    }
    for name, field in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        t = field.types[0]
        if t not in add:
            raise SystemExit(f"unhandled tokenizer field {name} of type {t}")
        add[t](name, field.contents())
