"""The errors t5export raises on purpose, one class per thing to act on.

Each also derives from the fitting builtin; messages name the thing and fix.
"""

from __future__ import annotations

# pylint: disable=g-importing-member
from t5export.errors._base import T5ExportError
from t5export.errors._model import (
    MissingAxesError,
    AxisRankMismatchError,
    UnmappedLogicalAxisError,
    AxesTreeMismatchError,
    NoOptimizerStateError,
    HyperparamNotInjectedError,
    SignatureError,
    T5XModelError,
    VariableMismatchError,
    IndivisibleShardingError,
    GinConfigError,
    MissingSampleInputsError,
)
from t5export.errors._check import (
    ExportCheckError,
    WrittenVariablesMismatchError,
    UnloadableSignatureError,
    NonFiniteParamsError,
    ServingTargetError,
    UncheckablePlatformsError,
    MissingOpsPackageError,
    JaxArtifactChecksumError,
    JaxArtifactVersionError,
    WarmupReplayError,
)
from t5export.errors._storage import (
    VersionExistsError,
    MetricNotNumericError,
    ExportDirError,
    UnsupportedURLError,
    StorageError,
    StorageCredentialsError,
    StoragePermissionError,
    StorageUnavailableError,
    BucketNotFoundError,
    VersionNotFoundError,
    VariablesFormatError,
    NoJaxArtifactError,
    ExportDirLockedError,
    LeaseLostError,
    CommitError,
)
from t5export.errors._run import (
    ExportFailedError,
    WriterFailedError,
    CheckpointNotFoundError,
    UnknownCheckpointFormatError,
    NoParamsInCheckpointError,
    ParamsMismatchError,
    WriterTimeoutError,
    BarrierTimeoutError,
    ActionOnOneProcessError,
    PeerExportError,
)
from t5export.errors._hf import (
    UnmappableModelError,
    HuggingFaceCheckError,
    CheckInterpreterError,
    HfDirOverlapError,
)
# pylint: enable=g-importing-member

__all__ = [
    'T5ExportError',
    'MissingAxesError',
    'AxisRankMismatchError',
    'UnmappedLogicalAxisError',
    'AxesTreeMismatchError',
    'NoOptimizerStateError',
    'HyperparamNotInjectedError',
    'SignatureError',
    'T5XModelError',
    'VariableMismatchError',
    'IndivisibleShardingError',
    'GinConfigError',
    'MissingSampleInputsError',
    'ExportCheckError',
    'WrittenVariablesMismatchError',
    'UnloadableSignatureError',
    'NonFiniteParamsError',
    'ServingTargetError',
    'UncheckablePlatformsError',
    'MissingOpsPackageError',
    'JaxArtifactChecksumError',
    'JaxArtifactVersionError',
    'WarmupReplayError',
    'VersionExistsError',
    'MetricNotNumericError',
    'ExportDirError',
    'UnsupportedURLError',
    'StorageError',
    'StorageCredentialsError',
    'StoragePermissionError',
    'StorageUnavailableError',
    'BucketNotFoundError',
    'VersionNotFoundError',
    'VariablesFormatError',
    'NoJaxArtifactError',
    'ExportDirLockedError',
    'LeaseLostError',
    'CommitError',
    'ExportFailedError',
    'WriterFailedError',
    'CheckpointNotFoundError',
    'UnknownCheckpointFormatError',
    'NoParamsInCheckpointError',
    'ParamsMismatchError',
    'WriterTimeoutError',
    'BarrierTimeoutError',
    'ActionOnOneProcessError',
    'PeerExportError',
    'UnmappableModelError',
    'HuggingFaceCheckError',
    'CheckInterpreterError',
    'HfDirOverlapError',
]

# Users meet them as t5export.errors.<Name> (tracebacks, reprs, pickles).
for _name in __all__:
  globals()[_name].__module__ = __name__
del _name
