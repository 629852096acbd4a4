"""Model zoo used by the tests: every model family lms-tf must handle.

Each builder returns a fresh, compiled Keras model with deterministic weights and a
deterministic batch stream (x, y), so two builds train to bit-identical numbers.
"""

import keras
import numpy as np
from keras import layers

BATCH = 8


def reseed(seed=7):
    """Starts a build from the same Keras state every time: layer names counted from zero, then ``seed``.

    Two builds must also get the same auto-generated names. Grappler's arithmetic optimizer orders
    the operands it regroups by node name, so the plain step of a model named ``conv2d_9, conv2d_10,
    conv2d_11`` (whose names sort 10, 11, 9) rounds differently from the same model named
    ``conv2d_6, conv2d_7, conv2d_8``: the subclassed model's weights differed by 1.5e-8 after one
    step between the third and fourth build in one process, and not with that optimizer off.
    """
    policy = keras.config.dtype_policy()  # clear_session resets the settings too; keep the policy
    keras.backend.clear_session(free_memory=False)
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)


def _images(n=3 * BATCH, size=24, channels=3, classes=5, seed=0):
    rng = np.random.RandomState(seed)
    return rng.rand(n, size, size, channels).astype("float32"), rng.randint(0, classes, n).astype("int32")


def _compile(model, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def sequential_cnn(**compile_kwargs):
    reseed()
    model = keras.Sequential([keras.Input((24, 24, 3))] + [
        layers.Conv2D(16, 3, padding="same", activation="relu", name=f"conv{i}") for i in range(4)] + [
        layers.MaxPooling2D(), layers.Flatten(), layers.Dense(5, name="head")], name="seq_cnn")
    return _compile(model, **compile_kwargs), _images()


def resnet_style():
    reseed()
    inputs = keras.Input((24, 24, 3))
    x = layers.Conv2D(16, 3, padding="same", name="stem")(inputs)
    for block in range(3):
        shortcut = x
        y = layers.Conv2D(16, 3, padding="same", name=f"b{block}_conv1")(x)
        y = layers.BatchNormalization(name=f"b{block}_bn1")(y)
        y = layers.Activation("relu")(y)
        y = layers.Conv2D(16, 3, padding="same", name=f"b{block}_conv2")(y)
        y = layers.BatchNormalization(name=f"b{block}_bn2")(y)
        x = layers.Activation("relu")(layers.Add()([shortcut, y]))
    outputs = layers.Dense(5)(layers.GlobalAveragePooling2D()(x))
    return _compile(keras.Model(inputs, outputs, name="resnet_style")), _images()


def inception_style():
    reseed()
    inputs = keras.Input((24, 24, 3))
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    for i in range(2):
        a = layers.Conv2D(8, 1, activation="relu", name=f"m{i}_1x1")(x)
        b = layers.Conv2D(8, 3, padding="same", activation="relu", name=f"m{i}_3x3")(
            layers.Conv2D(8, 1, activation="relu")(x))
        c = layers.Conv2D(8, 5, padding="same", activation="relu", name=f"m{i}_5x5")(x)
        d = layers.Conv2D(8, 1, activation="relu")(layers.MaxPooling2D(3, 1, padding="same")(x))
        x = layers.Concatenate()([a, b, c, d])
    outputs = layers.Dense(5)(layers.GlobalAveragePooling2D()(x))
    return _compile(keras.Model(inputs, outputs, name="inception_style")), _images()


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.convs = [layers.Conv2D(16, 3, padding="same", activation="relu") for _ in range(3)]
        self.pool = layers.GlobalAveragePooling2D()
        self.head = layers.Dense(5)

    def call(self, x):
        skip = None
        for conv in self.convs:
            x = conv(x)
            skip = x if skip is None else skip + x
        return self.head(self.pool(skip))


def subclassed():
    reseed()
    model = _Subclassed()
    model.build((None, 24, 24, 3))
    return _compile(model), _images()


def text_embedding():
    reseed()
    rng = np.random.RandomState(3)
    x = rng.randint(0, 500, (3 * BATCH, 64)).astype("int32")
    y = rng.randint(0, 5, 3 * BATCH).astype("int32")
    model = keras.Sequential([keras.Input((64,), dtype="int32"), layers.Embedding(500, 64),
                              layers.Dense(128, activation="relu"), layers.Dense(128, activation="relu"),
                              layers.GlobalAveragePooling1D(), layers.Dense(5)], name="text")
    return _compile(model), (x, y)


def dropout_mlp():
    reseed()
    x = np.random.RandomState(4).rand(3 * BATCH, 256).astype("float32")
    y = np.random.RandomState(5).randint(0, 5, 3 * BATCH).astype("int32")
    model = keras.Sequential([keras.Input((256,)), layers.Dense(512, activation="relu"), layers.Dropout(0.3, seed=1),
                              layers.Dense(512, activation="relu"), layers.Dropout(0.3, seed=2),
                              layers.Dense(512, activation="relu"), layers.Dense(5)], name="dropout")
    return _compile(model), (x, y)


def lstm_model():
    reseed()
    rng = np.random.RandomState(6)
    x = rng.rand(3 * BATCH, 12, 32).astype("float32")
    y = rng.randint(0, 5, 3 * BATCH).astype("int32")
    model = keras.Sequential([keras.Input((12, 32)), layers.Dense(64, activation="relu"),
                              layers.LSTM(32, return_sequences=True), layers.Dense(64, activation="relu"),
                              layers.GlobalAveragePooling1D(), layers.Dense(5)], name="lstm")
    return _compile(model), (x, y)


def shared_multi_input_residual():
    """The hang model of docs/design.md: two inputs, shared Conv2D + BatchNorm, a conv added back."""
    reseed()
    in_a, in_b = keras.Input((24, 24, 3), name="a"), keras.Input((24, 24, 3), name="b")
    shared_conv = layers.Conv2D(16, 3, padding="same", name="shared_conv")
    shared_bn = layers.BatchNormalization(name="shared_bn")
    fa = layers.Activation("relu")(shared_bn(shared_conv(in_a)))
    fb = layers.Activation("relu")(shared_bn(shared_conv(in_b)))
    merged = layers.Concatenate()([fa, fb])
    residual = layers.Conv2D(32, 3, padding="same", name="res_conv")(merged)
    x = layers.Activation("relu")(layers.Add()([merged, residual]))
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    outputs = layers.Dense(5)(layers.GlobalAveragePooling2D()(x))
    model = _compile(keras.Model([in_a, in_b], outputs, name="shared_residual"))
    (xa, y), (xb, _) = _images(seed=1), _images(seed=2)
    return model, ((xa, xb), y)


def _sequences(features=16, steps=20, seed=8):
    rng = np.random.RandomState(seed)
    return rng.rand(3 * BATCH, steps, features).astype("float32"), rng.randint(0, 5, 3 * BATCH).astype("int32")


def gru_model():
    reseed()
    model = keras.Sequential([keras.Input((20, 16)), layers.GRU(32), layers.Dense(5)], name="gru")
    return _compile(model), _sequences()


def bidirectional_text():
    """Embedding + Bidirectional GRU: the recurrent model of the "everyday inputs" report."""
    reseed()
    rng = np.random.RandomState(9)
    x = rng.randint(0, 200, (3 * BATCH, 24)).astype("int32")
    y = rng.randint(0, 5, 3 * BATCH).astype("int32")
    model = keras.Sequential([keras.Input((24,), dtype="int32"), layers.Embedding(200, 16),
                              layers.Bidirectional(layers.GRU(24, return_sequences=True)),
                              layers.GlobalAveragePooling1D(), layers.Dense(5)], name="bigru")
    return _compile(model), (x, y)


def stacked_recurrent():
    reseed()
    inputs = keras.Input((20, 16))
    x = layers.GRU(32, return_sequences=True, name="gru_a")(inputs)
    x = layers.LSTM(32, return_sequences=True, name="lstm_b")(x)
    x = layers.GRU(32, return_sequences=True, name="gru_c")(x)
    outputs = layers.Dense(5)(layers.GlobalAveragePooling1D()(x))
    return _compile(keras.Model(inputs, outputs, name="stacked_recurrent")), _sequences()


class MinimalRNNCell(layers.Layer):
    """A hand-written cell, as in Keras's RNN guide: h = tanh(x W + h U)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size = units, units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), initializer="glorot_uniform", name="kernel")
        self.recurrent = self.add_weight(shape=(self.units, self.units), initializer="orthogonal", name="recurrent")

    def call(self, inputs, states):
        import keras.ops as ops
        h = ops.tanh(ops.matmul(inputs, self.kernel) + ops.matmul(states[0], self.recurrent))
        return h, [h]


def custom_cell():
    reseed()
    model = keras.Sequential([keras.Input((20, 16)), layers.RNN(MinimalRNNCell(32), return_sequences=True),
                              layers.GlobalAveragePooling1D(), layers.Dense(5)], name="custom_cell")
    return _compile(model), _sequences()


#: Recurrent families: each layer is a While loop whose gradient reads its accumulated per-step values.
RECURRENT_ZOO = {
    "lstm": lstm_model,
    "gru": gru_model,
    "bidirectional_text": bidirectional_text,
    "stacked_recurrent": stacked_recurrent,
    "custom_cell": custom_cell,
}


FIT_ZOO = {
    "sequential_cnn": sequential_cnn,
    "resnet_style": resnet_style,
    "inception_style": inception_style,
    "subclassed": subclassed,
    "text_embedding": text_embedding,
    "dropout_mlp": dropout_mlp,
    "lstm": lstm_model,
    "shared_multi_input_residual": shared_multi_input_residual,
}
