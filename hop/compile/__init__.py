"""hop inside PyTorch 2's compiler: Dynamo capture of hop's operators and Inductor lowerings.

- :mod:`hop.compile.dynamo`: ``torch.compile`` and ``torch.export(strict=True)``
  capture each call of hop's operators as one ``torch.ops.hop.*`` node (hop's own
  Dynamo handlers; the heavy modules ``_dynamo_*`` load with Dynamo);
- :mod:`hop.compile.inductor`: the lowerings of those nodes;
- :mod:`hop.compile.onnx`: their translations for ``torch.onnx.export(dynamo=True)``.

``hop/ops`` never imports this package. ``import hop`` imports ``dynamo``,
``inductor`` and ``onnx`` but not torch._dynamo, torch._inductor or torch.onnx's
exporter: registrations wait until torch imports them (``hop.compile._hooks.on_import``).
"""
