"""SQLite values as Spark types, exactly: one value at a time (the tuple
path) or a whole column into an Arrow array (the Arrow path, the default).

Both give the same answer for every value: a value its column's type cannot
hold exactly (a REAL in a long column, text in a double one) raises
ConversionError, never a silent cast. The Arrow path hands a column's list
of values to pyarrow, which converts it in C; when pyarrow refuses the list
or could cast silently (a REAL truncated to an integer), the column is built
again value by value through `convert`, so both paths agree."""
from __future__ import annotations

import datetime
import decimal
from typing import Sequence

from pyspark.sql.types import (BinaryType, BooleanType, ByteType, DataType, DateType, DecimalType, DoubleType,
                               FloatType, IntegerType, LongType, ShortType, StringType, StructType,
                               TimestampType)

SUPPORTED_TYPES = (LongType, IntegerType, ShortType, ByteType, BooleanType, DoubleType, FloatType,
                   DecimalType, StringType, BinaryType, TimestampType, DateType)


class ConversionError(ValueError):
    """A value that the schema's type cannot hold exactly (a REAL in a LONG
    column, text in a DOUBLE one): an error of that database, like a failing
    query, handled by `on_error`."""


def spark_type(kinds: set) -> DataType:
    """The narrowest Spark type for values of these Python types (NULLs
    left out): long, double, binary, else string."""
    if not kinds:
        return StringType()
    if kinds <= {int}:
        return LongType()
    if kinds <= {int, float}:
        return DoubleType()
    if kinds <= {bytes}:
        return BinaryType()
    return StringType()


def _integer(value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConversionError("%r is not an integer" % (value,))
    if isinstance(value, float):
        if not value.is_integer():
            raise ConversionError("%r is not an integer" % (value,))
        value = int(value)
    if not lo <= value <= hi:
        raise ConversionError("%d is out of range" % value)
    return value


def _timestamp(value) -> datetime.datetime:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
    raise ConversionError("%r is not a time (unix seconds or ISO 8601)" % (value,))


# Spark integer type -> its range.
_RANGES = {
    LongType: (-(1 << 63), (1 << 63) - 1),
    IntegerType: (-(1 << 31), (1 << 31) - 1),
    ShortType: (-(1 << 15), (1 << 15) - 1),
    ByteType: (-128, 127),
    BooleanType: (0, 1),
}


def convert(value, dtype: DataType):
    """`value` (from SQLite) as `dtype` holds it, exactly; ConversionError
    when it cannot (never a silent cast such as a REAL truncated)."""
    if value is None:
        return None
    bounds = _RANGES.get(type(dtype))
    if bounds is not None:
        n = _integer(value, *bounds)
        return bool(n) if isinstance(dtype, BooleanType) else n
    if isinstance(dtype, (DoubleType, FloatType)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConversionError("%r is not a number" % (value,))
        return float(value)
    if isinstance(dtype, DecimalType):
        if isinstance(value, (bytes, bool)):
            raise ConversionError("%r is not a number" % (value,))
        try:
            return decimal.Decimal(str(value))
        except decimal.InvalidOperation:
            raise ConversionError("%r is not a number" % (value,)) from None
    if isinstance(dtype, StringType):
        return value if isinstance(value, str) else (
            value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    if isinstance(dtype, BinaryType):
        return value if isinstance(value, bytes) else str(value).encode()
    if isinstance(dtype, TimestampType):
        return _timestamp(value)
    if isinstance(dtype, DateType):
        if isinstance(value, str):
            try:
                return datetime.date.fromisoformat(value)
            except ValueError:
                pass
        return _timestamp(value).date()
    raise ConversionError("type %s is not supported" % dtype.simpleString())


def arrow_schema(schema: StructType):
    """The Arrow schema Spark expects of record batches for `schema`."""
    from pyspark.sql.pandas.types import to_arrow_schema
    return to_arrow_schema(schema, timezone="UTC")


def _spark_converter(dtype: DataType):
    """What PySpark itself applies to a Python value of `dtype` before Arrow
    (time zones of timestamps), so the Arrow path's value-by-value fallback
    gives what the tuple path gives."""
    try:
        from pyspark.sql.conversion import LocalDataToArrowConversion
        return LocalDataToArrowConversion._create_converter(dtype)
    except (ImportError, AttributeError):  # another PySpark: values go as they are
        return lambda v: v


class ColumnBuilder:
    """Builds Arrow arrays of one Spark type from lists of SQLite values.
    (pyarrow is imported here, on the executors, not when Spark's planning
    workers load the data source.)"""

    def __init__(self, dtype: DataType, atype):
        import pyarrow
        self.pa = pyarrow
        self.dtype = dtype
        self.atype = atype
        self.to_spark = _spark_converter(dtype)
        self.fast = self._fast_path()

    def _fast_path(self):
        # Booleans (0 and 1 only), decimals and times go value by value.
        if type(self.dtype) in _RANGES and not isinstance(self.dtype, BooleanType):
            return self._integers
        if isinstance(self.dtype, (DoubleType, FloatType, StringType, BinaryType)):
            # pyarrow refuses what would not be exact (an integer beyond 2^53
            # as a double, invalid UTF-8 as text, a number as text): the
            # value-by-value path then decides.
            return lambda values: self.pa.array(values, type=self.atype)
        return None

    def _integers(self, values: Sequence):
        # Typed conversion would truncate 3.5 to 3 silently: infer (int64 or
        # double), then a safe cast, which refuses fractions and overflow.
        pa = self.pa
        arr = pa.array(values)
        if not (pa.types.is_int64(arr.type) or pa.types.is_float64(arr.type)
                or pa.types.is_null(arr.type)):
            raise TypeError("not numbers")
        return arr.cast(self.atype, safe=True)

    def build(self, values: Sequence):
        """An array of `values`; ConversionError names the first value that
        the type cannot hold exactly."""
        pa = self.pa
        if self.fast is not None:
            try:
                return self.fast(values)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass  # the slow path below finds the value at fault, or builds it
        to_spark, dtype = self.to_spark, self.dtype
        column = [to_spark(convert(v, dtype)) for v in values]
        try:
            return pa.array(column, type=self.atype)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            # A decimal with more digits than its type has, for one.
            raise ConversionError("a value does not fit %s: %s"
                                  % (dtype.simpleString(), e)) from None
