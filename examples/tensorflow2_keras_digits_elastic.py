"""Elastic Keras on digits: training goes on when workers die or join.

    horovodrun -np 3 --min-np 2 --max-np 3 \
        --host-discovery-script ./discover_hosts.sh python examples/tensorflow2_keras_digits_elastic.py

Horovod's elastic Keras pattern: the model, its optimizer and the epoch and
batch counters live in a ``KerasState``, committed after every batch by
``CommitStateCallback``. When a worker is lost (kill -9 included), ``fit``
fails on the others with HorovodInternalError; ``hvd.elastic.run`` restores
the last commit, re-forms the world without the lost worker, broadcasts the
state from rank 0 and calls ``train`` again, which resumes at the epoch it
had reached. A reset callback rescales the learning rate to the new size.
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

parser = argparse.ArgumentParser(description="elastic Keras digits on hora")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--steps", type=int, default=120, help="steps per epoch for all workers")
parser.add_argument("--lr", type=float, default=0.001, help="learning rate for one worker")
args = parser.parse_args()

hvd.init()

digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    (digits.images / 16.0).astype("float32")[..., None], digits.target.astype("int64"),
    test_size=0.2, random_state=0)
dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
           .repeat().shuffle(2000, seed=hvd.rank()).batch(32))

model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"])


def on_state_reset():
    # The world changed size: rescale the learning rate.
    model.optimizer.learning_rate.assign(args.lr * hvd.size())


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
state.register_reset_callbacks([on_state_reset])
callbacks = [
    # Commit after every batch: a lost worker costs at most one batch of work.
    hvd.elastic.CommitStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.UpdateEpochStateCallback(state),
]


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"training from epoch {state.epoch} in a world of {hvd.size()}", flush=True)
    model.fit(dataset, steps_per_epoch=args.steps // hvd.size(), callbacks=callbacks,
              epochs=args.epochs - state.epoch, verbose=2 if hvd.rank() == 0 else 0)


train(state)

_, accuracy = model.evaluate(x_test, y_test, verbose=0)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print(f"rank {hvd.rank()} of {hvd.size()} test accuracy: {accuracy:.4f}")
print(f"rank {hvd.rank()} weights checksum: {hashlib.sha256(weights.tobytes()).hexdigest()[:16]}")
