"""Horovod's TensorFlow 2 Keras walk-through on Keras 3 (today's ``tf.keras``), on hora.

    horovodrun -np 2 python examples/tensorflow2_keras3_digits.py

The same steps as tensorflow2_keras_digits.py (the seed's, with the legacy
Keras), written for Keras 3: ``compile`` has no ``experimental_run_tf_function``
any more, checkpoints use the ``.keras`` format, and Horovod's other Keras
callbacks join in (metric averaging, learning-rate warmup). The data is
scikit-learn's bundled digits, so nothing is downloaded.
"""

import argparse
import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

keras = tf.keras

parser = argparse.ArgumentParser(description="Keras 3 digits on hora")
parser.add_argument("--epochs", type=int, default=24)
parser.add_argument("--steps", type=int, default=500, help="steps per epoch for all workers")
parser.add_argument("--warmup-epochs", type=int, default=1)
parser.add_argument("--checkpoint-dir", default=".")
args = parser.parse_args()

hvd.init()

gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    (digits.images / 16.0).astype("float32")[..., None], digits.target.astype("int64"),
    test_size=0.2, random_state=0)
dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
dataset = dataset.repeat().shuffle(2000, seed=hvd.rank()).batch(64)

keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast fixes them
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])

scaled_lr = 0.001 * hvd.size()
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"])

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Every rank logs the average over the ranks (put before checkpoints and TensorBoard).
    hvd.callbacks.MetricAverageCallback(),
    # Start at scaled_lr / size and reach scaled_lr after the warmup epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                             warmup_epochs=args.warmup_epochs),
]
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

model.fit(dataset, steps_per_epoch=args.steps // hvd.size(), callbacks=callbacks,
          epochs=args.epochs, verbose=2 if hvd.rank() == 0 else 0)

# A checkpoint loads back with its optimizer made distributed again (rank 0 saved it).
if hvd.rank() == 0:
    restored = hvd.load_model(os.path.join(args.checkpoint_dir,
                                           f"checkpoint-{args.epochs}.keras"))
    print("restored optimizer:", type(restored.optimizer).__name__)

_, accuracy = model.evaluate(x_test, y_test, verbose=0)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print(f"rank {hvd.rank()} test accuracy: {accuracy:.4f}")
print(f"rank {hvd.rank()} weights checksum: {hashlib.sha256(weights.tobytes()).hexdigest()[:16]}")
