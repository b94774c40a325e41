"""A custom TensorFlow 2 training loop with ``hvd.DistributedGradientTape``, on digits.

    horovodrun -np 2 python examples/tensorflow2_digits_gradient_tape.py

Horovod's tensorflow2 pattern: each rank trains on its own shard, the tape
averages the gradients over the ranks inside the ``tf.function`` step, and
the variables (model and optimizer) are broadcast from rank 0 after the
first step, when the optimizer has made its own.
"""

import argparse
import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

parser = argparse.ArgumentParser(description="DistributedGradientTape on digits")
parser.add_argument("--steps", type=int, default=600, help="steps for all workers together")
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

hvd.init()

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    (digits.images / 16.0).astype("float32")[..., None], digits.target.astype("int64"),
    test_size=0.2, random_state=0)
dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
           .shard(hvd.size(), hvd.rank()).repeat().shuffle(1000, seed=hvd.rank())
           .batch(args.batch_size))

tf.random.set_seed(hvd.rank())
model = tf.keras.Sequential([
    tf.keras.Input((8, 8, 1)),
    tf.keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
    tf.keras.layers.MaxPooling2D(2),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation="relu"),
    tf.keras.layers.Dense(10),
])
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Horovod: scale the learning rate by the number of workers.
opt = tf.keras.optimizers.Adam(0.001 * hvd.size())


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    # Horovod: the tape averages the gradients over the ranks.
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    # Horovod: after the first step (the optimizer's variables exist then), every
    # rank takes rank 0's variables.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss


for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
    loss = training_step(images, labels, batch == 0)
    if batch % 50 == 0 and hvd.rank() == 0:
        print(f"step {batch} loss {float(loss):.4f}")

logits = model(x_test, training=False)
accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print(f"rank {hvd.rank()} test accuracy: {accuracy:.4f}")
print(f"rank {hvd.rank()} weights checksum: {hashlib.sha256(weights.tobytes()).hexdigest()[:16]}")
