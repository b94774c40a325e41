"""Horovod's TensorFlow 2 Keras walk-through, on hora, with the legacy Keras it was written for.

    horovodrun -np 2 python examples/tensorflow2_keras_digits.py

The steps are the seed's, one by one (import, init, pin, scale the learning
rate, DistributedOptimizer, experimental_run_tf_function=False, broadcast
callback, rank-0 checkpoints, verbose on rank 0); only the data differs:
scikit-learn's bundled digits instead of MNIST, so nothing is downloaded.
Needs tf-keras (pip install 'hora[tensorflow]'): Keras 2 is what
``experimental_run_tf_function`` belongs to, so TF_USE_LEGACY_KERAS=1 is set here.
See tensorflow2_keras3_digits.py for the same on Keras 3.
"""

import argparse
import hashlib
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

keras = tf.keras

parser = argparse.ArgumentParser(description="Keras digits on hora (Horovod's walk-through)")
parser.add_argument("--epochs", type=int, default=24)
parser.add_argument("--steps", type=int, default=500, help="steps per epoch for all workers")
parser.add_argument("--checkpoint-dir", default=".")
args = parser.parse_args()

# Step two: initialize horovod
hvd.init()

# Step three: pin each GPU to a single process
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

# Step four: import the data, build the model, and scale the learning rate to the number of GPUs
digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    (digits.images / 16.0).astype("float32")[..., None], digits.target.astype("int64"),
    test_size=0.2, random_state=0)
dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
dataset = dataset.repeat().shuffle(2000, seed=hvd.rank()).batch(64)

tf.random.set_seed(hvd.rank())  # different initial weights: the broadcast makes them equal
mnist_model = keras.Sequential([
    keras.layers.Conv2D(16, [3, 3], activation='relu', padding='same', input_shape=(8, 8, 1)),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation='relu'),
    keras.layers.Dense(10, activation='softmax'),
])

# Scale learning rate to # of GPUs
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Step five: Wrap the optimizer with a Horovod DistributedOptimizer
opt = hvd.DistributedOptimizer(opt)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=['accuracy'],
                    experimental_run_tf_function=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
]

# Step six: save checkpoints only on worker 0 to prevent corruption
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, 'checkpoint-{epoch}.h5')))

# Step seven: Begin the training!
mnist_model.fit(dataset,
                steps_per_epoch=args.steps // hvd.size(),
                callbacks=callbacks,
                epochs=args.epochs,
                verbose=1 if hvd.rank() == 0 else 0)

# Every rank checks itself: the held-out accuracy, and a checksum of its weights.
_, accuracy = mnist_model.evaluate(x_test, y_test, verbose=0)
weights = np.concatenate([w.ravel() for w in mnist_model.get_weights()])
print(f"rank {hvd.rank()} test accuracy: {accuracy:.4f}")
print(f"rank {hvd.rank()} weights checksum: {hashlib.sha256(weights.tobytes()).hexdigest()[:16]}")
