"""A 100-item task set for `kvpilot eval`: the capital of a country, four choices each.

Source: written for kvpilot from common geographic knowledge (capitals as of 2026); the distractors
are other items' capitals, picked deterministically. Scored by the model's log-probability of each
choice after the prompt, so it measures how a scheme shifts the model's preferences, not how well a
135M model answers trivia.
"""

from __future__ import annotations

CAPITALS: tuple[tuple[str, str], ...] = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("United Kingdom", "London"), ("Ireland", "Dublin"), ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"), ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Czech Republic", "Prague"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"), ("Denmark", "Copenhagen"),
    ("Finland", "Helsinki"), ("Iceland", "Reykjavik"), ("Russia", "Moscow"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Slovenia", "Ljubljana"), ("Slovakia", "Bratislava"),
    ("Lithuania", "Vilnius"), ("Latvia", "Riga"), ("Estonia", "Tallinn"), ("Turkey", "Ankara"), ("Egypt", "Cairo"),
    ("Morocco", "Rabat"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Nigeria", "Abuja"), ("Kenya", "Nairobi"),
    ("Ethiopia", "Addis Ababa"), ("Ghana", "Accra"), ("Senegal", "Dakar"), ("South Africa", "Pretoria"),
    ("Tanzania", "Dodoma"), ("Uganda", "Kampala"), ("Angola", "Luanda"), ("Zimbabwe", "Harare"), ("Zambia", "Lusaka"),
    ("Sudan", "Khartoum"), ("Libya", "Tripoli"), ("Mali", "Bamako"), ("China", "Beijing"), ("Japan", "Tokyo"),
    ("South Korea", "Seoul"), ("North Korea", "Pyongyang"), ("India", "New Delhi"), ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"), ("Sri Lanka", "Colombo"), ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"), ("Cambodia", "Phnom Penh"), ("Laos", "Vientiane"), ("Malaysia", "Kuala Lumpur"),
    ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("Singapore", "Singapore"), ("Mongolia", "Ulaanbaatar"),
    ("Afghanistan", "Kabul"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Syria", "Damascus"), ("Jordan", "Amman"),
    ("Lebanon", "Beirut"), ("Israel", "Jerusalem"), ("Saudi Arabia", "Riyadh"), ("Qatar", "Doha"), ("Kuwait", "Kuwait City"),
    ("Oman", "Muscat"), ("Yemen", "Sanaa"), ("Kazakhstan", "Astana"), ("Uzbekistan", "Tashkent"), ("Georgia", "Tbilisi"),
    ("Armenia", "Yerevan"), ("Azerbaijan", "Baku"), ("United States", "Washington"), ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"), ("Cuba", "Havana"), ("Jamaica", "Kingston"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"), ("Peru", "Lima"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Ecuador", "Quito"),
    ("Bolivia", "Sucre"), ("Uruguay", "Montevideo"), ("Australia", "Canberra"), ("New Zealand", "Wellington"),
)


def choices(index: int) -> list[str]:
    """The correct capital first, then three others', the same every run."""
    n = len(CAPITALS)
    return [CAPITALS[index][1]] + [CAPITALS[(index + step) % n][1] for step in (17, 41, 73)]
