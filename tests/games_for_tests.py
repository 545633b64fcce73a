"""Games for tests/games_check.py and tests/test_games.py: OpenSpiel's TicTacToe, recorded or broken."""

from environments import OpenSpielGame


class RecordingGame(OpenSpielGame):
    """TicTacToe that records every move it is given and every bot it is asked for, with the seat to move."""

    def reset(self, row: dict) -> None:
        super().reset(row)
        self.moves, self.bot_seats = [], []

    def step(self, action: str) -> str | None:
        self.moves.append((self.current_player(), action))
        return super().step(action)

    def bot_move(self, name: str) -> str:
        self.bot_seats.append(self.current_player())
        return super().bot_move(name)


class RejectingGame(OpenSpielGame):
    """TicTacToe where every move is illegal."""

    def step(self, action: str) -> str | None:
        return "No move is legal here."


class SeatlessGame(OpenSpielGame):
    """Says it has 2 players, then that seat 5 is to move: players and turns disagree."""

    def current_player(self) -> int:
        return 5
