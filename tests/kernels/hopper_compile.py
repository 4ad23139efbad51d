"""Triton codegen + ptxas for sm_90 without a GPU, for the kernels' compile tests: catches what the
interpreter accepts but the compiler does not, and tiles that do not fit in shared memory."""

import inspect

H200_SHARED_MEMORY = 232448  # bytes per block (what Triton reports as the hardware limit)


def compile_for_hopper(jitted, constexprs: dict, config: dict, pointer_types: dict) -> int:
    """Shared memory bytes of `jitted` (a triton.jit function) compiled for sm_90 with `constexprs`
    and the launch `config` (num_warps, num_stages). Parameters ending in `_ptr` are bf16 pointers
    unless `pointer_types` says otherwise, `scale*` ones fp32, the rest i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(jitted.fn).parameters)
    signature = {name: "constexpr" if name in constexprs else pointer_types.get(name, "*bf16")
                 if name.endswith("_ptr") else "fp32" if name.startswith("scale") else "i32" for name in names}
    source = ASTSource(fn=jitted, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared
