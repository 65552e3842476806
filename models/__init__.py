"""Model zoo (plain torch), ONNX export for training, and the embedded default's pretraining.

``models.zoo.build(name, num_classes)`` builds a model; ``models.export.export_onnx`` writes a
training-ready ONNX file; ``python -m models.export NAME -o PATH`` does both from the shell.
"""
